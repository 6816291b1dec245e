"""What the three apps share: config, registry, metrics, keys, the thread pool, the drain."""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
from collections.abc import Iterator
from dataclasses import dataclass, field

from aiohttp import web

from server.adapters import AdapterRegistry
from server.auth import Api, KeyStore
from server.config import ServerConfig
from server.limits import RequestLimits
from server.metrics import ServerMetrics
from server.registry import ModelRegistry


@dataclass(slots=True, eq=False)
class Drain:
    """Requests being answered, and whether the server is shutting down.

    Every inference and management request runs inside `track()`; once `begin()` was called
    new requests are refused (503) and `wait_idle` returns as soon as the last tracked request
    ended (an event, not polling)."""

    draining: bool = False
    in_flight: int = 0
    _idle: asyncio.Event = field(default_factory=asyncio.Event)

    def begin(self) -> None:
        self.draining = True
        if self.in_flight == 0:
            self._idle.set()

    @contextlib.contextmanager
    def track(self) -> Iterator[None]:
        self.in_flight += 1
        try:
            yield
        finally:
            self.in_flight -= 1
            if self.draining and self.in_flight == 0:
                self._idle.set()

    async def wait_idle(self, timeout: float) -> bool:
        """Wait up to `timeout` seconds for the tracked requests to end; True if they did."""
        try:
            await asyncio.wait_for(self._idle.wait(), timeout)
        except asyncio.TimeoutError:
            return False
        return True


@dataclass(slots=True, eq=False)
class ServerState:
    config: ServerConfig
    registry: ModelRegistry
    metrics: ServerMetrics
    keys: KeyStore | None  # None: token authorization is off
    executor: concurrent.futures.ThreadPoolExecutor  # tokenization etc. off the event loop
    limits: RequestLimits = field(default_factory=RequestLimits)  # grammar checks, prompt bounds
    drain: Drain = field(default_factory=Drain)
    adapters: AdapterRegistry = field(default_factory=AdapterRegistry)  # LoRA adapters on the models' workers
    ports: dict[str, int] = field(default_factory=dict)  # API -> bound port (server.serve fills it)

    @property
    def inference_key(self) -> str | None:
        return self.keys.key(Api.INFERENCE) if self.keys else None

    @property
    def management_key(self) -> str | None:
        return self.keys.key(Api.MANAGEMENT) if self.keys else None

    @property
    def draining(self) -> bool:
        return self.drain.draining

    def serving(self) -> bool:
        """/ping and /ready: the startup registrations are done, the server is not draining,
        and every version that should serve (minWorkers > 0) has a ready worker. A version
        scaled to 0 workers on purpose is not a failure."""
        registry = self.registry
        return (registry.startup_done and not self.drain.draining
                and all(v.pool.ready_engines() or v.pool.sleeping_slots()
                        for v in registry.all_versions() if v.min_workers > 0))


STATE_KEY = web.AppKey("pagedserve_state", ServerState)
