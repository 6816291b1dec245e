"""Worker supervision for one model version: start, scale, restart with back-off, stop.

Each worker is one engine-core process behind an `AsyncLLM`. A slot is a place for a worker: it
keeps its id and start time across restarts. When a worker dies (`on_dead`), or a worker started
in the background fails to start, its slot starts it again after an exponential back-off
(0.5 s, 1 s, 2 s, ... capped), counted in consecutive failures; a worker that stayed up for
`STABLE_AFTER_S` resets the count. A stalled worker (silent past its heartbeat timeout, see
`pagedserve.engine.core.client`) is killed and counts as dead. Other slots never notice. A synchronous
start (register or scale with synchronous=true) does not retry: its caller reports the failure.
Scaling down picks idle workers first and lets their requests finish before stopping them.
"""

from __future__ import annotations

import asyncio
import contextlib
import enum
import logging
import os
import signal
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from datetime import datetime, timezone
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from pagedserve.engine.core.async_llm import AsyncLLM

logger = logging.getLogger(__name__)

BACKOFF_BASE_S = 0.5
BACKOFF_MAX_S = 30.0
STABLE_AFTER_S = 60.0
UNLOAD_WAIT_S = 30.0  # how long a scaled-down worker may take to finish its requests

# make_engine(worker_name, on_dead) -> a not-yet-started AsyncLLM
EngineFactory = Callable[[str, Callable[["AsyncLLM"], None]], "AsyncLLM"]


class WorkerStatus(str, enum.Enum):
    """TorchServe's worker states, as `GET /models/{m}` shows them."""

    STARTING = "STARTING"
    READY = "READY"
    UNLOADING = "UNLOADING"
    RESTARTING = "RESTARTING"  # died; waiting out the back-off before starting again
    SLEEPING = "SLEEPING"  # weights and KV pool freed, the process kept (pagedserve.server.workers.lifecycle)
    STOPPED = "STOPPED"


class NoWorkerError(RuntimeError):
    """A version has no ready worker right now (503)."""


class WorkerStartFailed(RuntimeError):
    """A worker could not start (the engine's message says why)."""


@dataclass(slots=True, eq=False)
class WorkerSlot:
    id: str
    status: WorkerStatus = WorkerStatus.STARTING
    engine: AsyncLLM | None = None
    start_time: datetime = field(default_factory=lambda: datetime.now(timezone.utc))
    ready_since: float | None = None  # time.monotonic() when the current engine became ready
    failures: int = 0  # consecutive deaths / failed starts
    restarts: int = 0  # total restarts, for the describe API
    last_error: str | None = None
    start_failed: bool = False  # its last start failed (cleared once a start succeeds)
    task: asyncio.Task | None = None  # the start / restart in progress
    starting: bool = False  # inside engine.start(): its threads own the engine's sockets
    overhead: int | None = None  # measured when ready: RSS minus weights and KV pool
    sleep_rss: int | None = None  # RSS measured after falling asleep
    index: int = 0  # its place among the pool's workers (the smallest free): picks its GPUs
    devices: tuple[int, ...] = ()  # the GPUs it was given (server/workers/devices.py); () on the CPU

    @property
    def is_ready(self) -> bool:
        return self.status is WorkerStatus.READY and self.engine is not None and self.engine.is_ready

    def started_engine(self) -> AsyncLLM:
        """The slot's engine (a slot that is ready or asleep has one)."""
        if self.engine is None:
            raise RuntimeError(f"worker {self.id} has no engine")
        return self.engine


def backoff_delay(failures: int) -> float:
    return min(BACKOFF_MAX_S, BACKOFF_BASE_S * (2 ** max(0, failures - 1)))


class WorkerPool:
    """The workers of one model version."""

    def __init__(
        self,
        label: str,
        make_engine: EngineFactory,
        next_id: Callable[[], str],
        startup_timeout: float,
        on_change: Callable[[], None] | None = None,
        on_ready: Callable[[WorkerSlot], None] | None = None,
    ) -> None:
        self.label = label  # "model/version", for logs and worker names
        self._make_engine = make_engine
        self._next_id = next_id
        self._startup_timeout = startup_timeout
        self._on_change = on_change or (lambda: None)
        self._on_ready = on_ready or (lambda slot: None)  # each time a worker becomes ready
        self.slots: list[WorkerSlot] = []
        self._tasks: set[asyncio.Task] = set()
        self._closed = False

    # -- queries -------------------------------------------------------------------------
    def ready_engines(self) -> list[AsyncLLM]:
        return [s.engine for s in self.slots if s.is_ready and s.engine is not None]

    def active_slots(self) -> list[WorkerSlot]:
        return [s for s in self.slots if s.status is not WorkerStatus.UNLOADING]

    def sleeping_slots(self) -> list[WorkerSlot]:
        return [s for s in self.slots if s.status is WorkerStatus.SLEEPING]

    @property
    def size(self) -> int:
        return len(self.active_slots())

    def changed(self) -> None:
        """Tell the owner the workers changed (a worker put to sleep or woken)."""
        self._on_change()

    # -- scaling -------------------------------------------------------------------------
    async def scale_to(self, n: int, *, wait: bool) -> None:
        """Reach `n` workers. With `wait`, return once new workers are ready (raise
        `WorkerStartFailed` if one cannot start; it is removed) and removed ones are stopped."""
        active = self.active_slots()
        if n > len(active):
            new = self.add_workers(n - len(active), give_up=wait)
            if wait:
                await self.wait_started(new)
        elif n < len(active):
            # Idle and not-yet-ready workers go first, then the least loaded.
            victims = sorted(active, key=lambda s: (s.is_ready, _load(s)))[: len(active) - n]
            stops = [self._spawn(self._unload(s)) for s in victims]
            if wait:
                await asyncio.gather(*stops, return_exceptions=True)

    def add_workers(self, n: int, *, give_up: bool) -> list[WorkerSlot]:
        """Start `n` more workers (their slots exist when this returns); with `give_up` a
        failed start is not retried (see `wait_started`)."""
        return [self._add_slot(give_up=give_up) for _ in range(n)]

    def _add_slot(self, *, give_up: bool) -> WorkerSlot:
        taken = {s.index for s in self.slots}
        slot = WorkerSlot(id=self._next_id(), index=next(i for i in range(len(taken) + 1) if i not in taken))
        self.slots.append(slot)
        slot.task = self._spawn(self._run_start(slot, give_up=give_up))
        self._on_change()
        return slot

    async def wait_started(self, slots: list[WorkerSlot]) -> None:
        """Wait for `slots` to start; WorkerStartFailed (they are removed) if any did not."""
        await asyncio.gather(*(s.task for s in slots if s.task), return_exceptions=True)
        failed = [s for s in slots if not s.is_ready]
        if failed:
            errors = "; ".join(f"worker {s.id}: {s.last_error or s.status.value}" for s in failed)
            for s in failed:
                await self._unload(s)
            raise WorkerStartFailed(errors)

    async def _run_start(self, slot: WorkerSlot, *, give_up: bool) -> None:
        """Start the slot's engine. With `give_up` a failed start stops there (a synchronous
        caller reports it); otherwise it is retried with back-off until it succeeds or the
        slot is removed."""
        while slot.status in (WorkerStatus.STARTING, WorkerStatus.RESTARTING) and not self._closed:
            slot.status = WorkerStatus.STARTING
            engine = None
            try:
                engine = self._make_engine(f"{self.label}#{slot.id}", self._on_dead)
                slot.engine = engine
                slot.starting = True
                try:
                    await engine.start(timeout=self._startup_timeout)
                finally:
                    slot.starting = False
            except (RuntimeError, ValueError, OSError, TimeoutError) as exc:  # EngineStartError too
                slot.last_error = str(exc) or type(exc).__name__
                slot.start_failed = True
                slot.failures += 1
                logger.error("worker %s of %s failed to start: %s", slot.id, self.label, exc)
                if engine is not None:
                    await _quiet_shutdown(engine)
                if give_up or slot.status is WorkerStatus.UNLOADING:
                    slot.status = WorkerStatus.STOPPED
                    return
                slot.status = WorkerStatus.RESTARTING
                await asyncio.sleep(backoff_delay(slot.failures))
                continue
            if slot.status is WorkerStatus.UNLOADING:  # removed while starting
                await _quiet_shutdown(engine)
                return
            slot.status = WorkerStatus.READY
            slot.ready_since = time.monotonic()
            slot.last_error = None
            slot.start_failed = False
            self._on_ready(slot)
            logger.info("worker %s of %s ready (pid %s)", slot.id, self.label, engine.pid)
            self._on_change()
            return

    def restart(self, slot: WorkerSlot) -> None:
        """Replace a worker that is alive but unusable (it failed to wake): kill it, start anew."""
        if slot.engine is not None and slot.engine.pid is not None:
            with contextlib.suppress(ProcessLookupError):
                os.kill(slot.engine.pid, signal.SIGKILL)  # the output thread reports the death

    def _on_dead(self, engine: AsyncLLM) -> None:
        """Called on the event loop when a worker process is found dead."""
        slot = next((s for s in self.slots if s.engine is engine), None)
        if slot is None or slot.status in (WorkerStatus.UNLOADING, WorkerStatus.STOPPED) or self._closed:
            return
        lived = time.monotonic() - slot.ready_since if slot.ready_since is not None else 0.0
        slot.failures = 1 if lived >= STABLE_AFTER_S else slot.failures + 1
        slot.restarts += 1
        slot.last_error = engine.dead_reason or f"worker process {engine.pid} died"
        slot.status = WorkerStatus.RESTARTING
        slot.ready_since = None
        delay = backoff_delay(slot.failures)
        logger.warning("worker %s of %s (pid %s) died; restarting in %.1fs", slot.id, self.label, engine.pid, delay)

        async def restart() -> None:
            await _quiet_shutdown(engine)
            await asyncio.sleep(delay)
            await self._run_start(slot, give_up=False)

        slot.task = self._spawn(restart())
        self._on_change()

    async def _unload(self, slot: WorkerSlot) -> None:
        """Stop routing to the slot, let its requests finish (bounded), stop its process."""
        slot.status = WorkerStatus.UNLOADING
        await _halt(slot)
        engine = slot.engine
        if engine is not None:
            deadline = time.monotonic() + UNLOAD_WAIT_S
            while engine.is_ready and engine.num_unfinished and time.monotonic() < deadline:
                await asyncio.sleep(0.05)
            await _quiet_shutdown(engine)
        slot.status = WorkerStatus.STOPPED
        if slot in self.slots:
            self.slots.remove(slot)
        self._on_change()

    async def shutdown(self) -> None:
        """Stop every worker now (in-flight requests end with an error)."""
        self._closed = True
        for s in self.slots:
            s.status = WorkerStatus.UNLOADING
        await asyncio.gather(*(_halt(s) for s in self.slots))
        for task in list(self._tasks):
            task.cancel()
        engines = [s.engine for s in self.slots if s.engine is not None]
        for s in self.slots:
            s.status = WorkerStatus.STOPPED
        await asyncio.gather(*(_quiet_shutdown(e) for e in engines))
        self.slots.clear()

    def _spawn(self, coro) -> asyncio.Task:
        task = asyncio.get_running_loop().create_task(coro)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)
        return task


async def _halt(slot: WorkerSlot) -> None:
    """End the slot's start or restart task (its status is already UNLOADING).

    A task inside `engine.start()` is not cancelled: the start's executor threads would keep
    using the engine's ZeroMQ sockets while the cancellation closes them from another thread.
    Its process is killed instead; `start()` sees the death, cleans up in order and fails, and
    the task ends. A task that is backing off or cleaning up is simply cancelled.
    """
    task = slot.task
    if task is None or task.done() or task is asyncio.current_task():
        return
    if not slot.starting:
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)
        return
    killed = None
    while not task.done():
        engine = slot.engine
        if engine is not None and engine is not killed and engine.pid is not None:
            killed = engine  # each process once: a reaped pid may be reused
            try:
                os.kill(engine.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        await asyncio.wait({task}, timeout=0.1)


def _load(slot: WorkerSlot) -> int:
    return slot.engine.num_unfinished if slot.engine is not None and slot.engine.is_ready else 0


async def _quiet_shutdown(engine: AsyncLLM) -> None:
    try:
        await engine.shutdown()
    except (RuntimeError, OSError, TimeoutError) as exc:  # already dead, or never started
        logger.debug("shutdown of %s: %s", engine, exc)
