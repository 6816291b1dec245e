"""What the three apps share: config, registry, metrics, keys, the thread pool, the drain."""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
from collections.abc import Iterator
from dataclasses import dataclass, field

from aiohttp import web

from pagedserve.server.common.auth import Api, KeyStore
from pagedserve.server.common.config import ServerConfig
from pagedserve.server.metrics.families import ServerMetrics
from pagedserve.server.serving.limits import RequestLimits
from pagedserve.server.workers.adapters import AdapterRegistry
from pagedserve.server.workers.registry import ModelRegistry


@dataclass(slots=True, eq=False)
class Drain:
    """Requests being answered (per client address too), and whether the server is shutting down.

    Every inference and management request runs inside `track()`; once `begin()` was called
    new requests are refused (503) and `wait_idle` returns as soon as the last tracked request
    ended (an event, not polling). `cut()` cancels the requests still running when the grace
    is over; the drain middleware turns that cancellation into a 503 error reply (an error
    event and `[DONE]` on a stream that is open)."""

    draining: bool = False
    in_flight: int = 0
    max_per_client: int | None = None  # None: no share per client address
    cutting: bool = False
    by_client: dict[str, int] = field(default_factory=dict)
    _tasks: set[asyncio.Task] = field(default_factory=set)
    _idle: asyncio.Event = field(default_factory=asyncio.Event)

    def begin(self) -> None:
        self.draining = True
        if self.in_flight == 0:
            self._idle.set()

    def over_share(self, client: str) -> str | None:
        """Why a new request from `client` is refused (its share is taken), or None."""
        held = self.by_client.get(client, 0)
        if self.max_per_client is not None and held >= self.max_per_client:
            return (
                f"this client address has {held} requests being answered "
                f"(max_in_flight_per_client); retry when one has finished"
            )
        return None

    @contextlib.contextmanager
    def track(self, client: str = "") -> Iterator[None]:
        self.by_client[client] = self.by_client.get(client, 0) + 1
        self.in_flight += 1
        task = asyncio.current_task()
        if task is not None:
            self._tasks.add(task)
        try:
            yield
        finally:
            self._tasks.discard(task)
            self.in_flight -= 1
            left = self.by_client.pop(client, 1) - 1
            if left:
                self.by_client[client] = left
            if self.draining and self.in_flight == 0:
                self._idle.set()

    def cut(self) -> int:
        """Cancel every request still being answered (the grace is over); how many."""
        self.cutting = True
        for task in self._tasks:
            task.cancel()
        return len(self._tasks)

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
    ports: dict[str, int] = field(default_factory=dict)  # API -> bound port (pagedserve.server.app.serve fills it)

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
        return registry.startup_done and not self.drain.draining and not self.not_serving()

    def not_serving(self) -> list[str]:
        """The versions that should serve (minWorkers > 0) with no ready or sleeping worker,
        as "name version" (a crash-looping model is one)."""
        return [
            f"{v.name} {v.version}"
            for v in self.registry.all_versions()
            if v.min_workers > 0 and not (v.pool.ready_engines() or v.pool.sleeping_slots())
        ]


STATE_KEY = web.AppKey("pagedserve_state", ServerState)
