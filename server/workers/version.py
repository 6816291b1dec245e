"""One registered version of a model (`ModelVersion`: its archive, tokenizer, workers, router,
admission count and keep-alive state) and a model's versions (`RegisteredModel`).
`pagedserve.server.workers.registry` owns them; the lifecycle and the apps read them."""

from __future__ import annotations

import contextlib
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from datetime import datetime, timezone
from pathlib import Path
from typing import TYPE_CHECKING, Any

from pagedserve.engine.model.model_config import ModelConfig
from pagedserve.handlers.base_handler import BaseHandler, Context
from pagedserve.server.workers.archives import LoadedArchive
from pagedserve.server.workers.disagg import DisaggRouter
from pagedserve.server.workers.pool import NoWorkerError, WorkerPool
from pagedserve.server.workers.routing import Router
from pagedserve.server.workers.rules import QueueFullError

if TYPE_CHECKING:
    from pagedserve.engine.core.async_llm import AsyncLLM
    from pagedserve.engine.request.inputs import EngineInput


@dataclass(slots=True, eq=False)
class ModelVersion:
    """One registered version of a model and its workers."""

    name: str
    version: str
    model_dir: Path
    context: Context
    tokenizer: Any
    archive: LoadedArchive
    url: str  # as registered (relative to the model store when inside it)
    pool: WorkerPool
    min_workers: int
    max_workers: int
    job_queue_size: int
    loaded_at_startup: bool = False
    max_model_len: int | None = None
    handler: BaseHandler | None = None  # a custom handler around the workers (/predictions)
    in_flight: int = 0
    router: Router = field(default_factory=Router)
    # Workers in prefill / decode roles (model-config workerRoles): who prefills and who decodes.
    disagg: DisaggRouter | None = None
    registered_at: datetime = field(default_factory=lambda: datetime.now(timezone.utc))
    # The lifecycle (pagedserve.server.workers.lifecycle): pinned versions are never unloaded; keep_alive seconds
    # (None: the server's default, < 0: forever); last_used and expires_at are monotonic times.
    pinned: bool = False
    keep_alive: float | None = None
    last_used: float = 0.0
    expires_at: float | None = None
    sizes: tuple[int, int] | None = None  # (weights, KV pool) bytes of one worker
    on_idle: Callable[[ModelVersion, float | None], None] | None = None

    @property
    def model_config(self) -> ModelConfig:
        return self.context.model_config

    def workers(self) -> list[AsyncLLM]:
        return self.pool.ready_engines()

    def pick_worker(self, token_ids: Sequence[int] = (), inp: EngineInput | None = None) -> AsyncLLM:
        """The ready worker the version's router picks for a prompt of `token_ids` (least
        loaded, or the one that holds the prompt's prefix: `pagedserve.server.workers.routing`).
        With workers in prefill and decode roles, a `Handoff` that runs the request over the
        pair the version's `DisaggRouter` picks (`pagedserve.server.workers.disagg`), which the
        request path drives like a worker."""
        ready = self._ready()  # NoWorkerError when none is
        if self.disagg is not None and inp is not None and inp.kv_produce:
            producer = self.disagg.pick_producer(self.pool.slots, token_ids)
            if producer is not None:
                return producer
        elif self.disagg is not None:
            handoff = self.disagg.pick(self.pool.slots, token_ids, inp)
            engine = handoff.decode
            if self.max_model_len is None and engine.info is not None:
                self.max_model_len = engine.info.max_model_len
            return handoff  # type: ignore[return-value]
        engine = self.router.route(ready, token_ids).engine
        if self.max_model_len is None and engine.info is not None:
            self.max_model_len = engine.info.max_model_len
        return engine

    def _ready(self) -> list[AsyncLLM]:
        ready = self.pool.ready_engines()
        if not ready:
            raise NoWorkerError(
                f"model {self.name!r} version {self.version!r} has no ready worker right now; retry shortly"
            )
        return ready

    @contextlib.contextmanager
    def admit(self, keep_alive: float | None = None) -> Iterator[None]:
        """Count one request in flight for the whole `with` block; QueueFullError when full.
        When the last one in flight ends, the keep-alive (the request's `keep_alive` seconds,
        else the version's) starts counting."""
        if self.in_flight >= self.job_queue_size:
            raise QueueFullError(
                f"model {self.name!r} version {self.version!r} has "
                f"{self.in_flight} requests in flight (jobQueueSize="
                f"{self.job_queue_size}); retry later"
            )
        self.in_flight += 1
        self.last_used = time.monotonic()
        self.expires_at = None
        try:
            yield
        finally:
            self.in_flight -= 1
            self.last_used = time.monotonic()
            if self.in_flight == 0 and self.on_idle is not None:
                self.on_idle(self, keep_alive)


@dataclass(slots=True, eq=False)
class RegisteredModel:
    name: str
    versions: dict[str, ModelVersion] = field(default_factory=dict)
    default_version: str | None = None

    @property
    def default(self) -> ModelVersion:
        """The default version (a model is registered with one; KeyError otherwise)."""
        return self.versions[self.default_version or ""]


# make_engine(model_version, worker_name, on_dead) -> a not-started AsyncLLM
EngineBuilder = Callable[[ModelVersion, str, Callable[["AsyncLLM"], None]], "AsyncLLM"]
