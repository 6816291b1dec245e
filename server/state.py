"""What the three apps share: config, registry, metrics, keys, the thread pool, draining."""

from __future__ import annotations

import concurrent.futures
from dataclasses import dataclass, field

from aiohttp import web

from server.config import ServerConfig
from server.limits import RequestLimits
from server.metrics import ServerMetrics
from server.registry import ModelRegistry


@dataclass(slots=True, eq=False)
class ServerState:
    config: ServerConfig
    registry: ModelRegistry
    metrics: ServerMetrics
    inference_key: str | None  # None: token authorization is off
    management_key: str | None
    executor: concurrent.futures.ThreadPoolExecutor  # tokenization etc. off the event loop
    limits: RequestLimits = field(default_factory=RequestLimits)  # grammar checks, prompt bounds
    draining: bool = False  # True once SIGTERM arrived: new requests get 503
    http_in_flight: int = 0  # inference and management requests being answered


STATE_KEY = web.AppKey("pagedserve_state", ServerState)
