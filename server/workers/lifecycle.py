"""Model versions' lifecycle inside one memory budget: load on demand, keep-alive, LRU eviction,
sleep and wake, pinning.

States of a version (`state_of`): `unloaded` (no worker), `loading` (a worker starting),
`loaded`, `sleeping` (its workers' weights and KV pools freed, the processes kept).

- Every worker start that adds memory (a registration's workers, a scale-up, a load on demand,
  a wake) goes through `start_workers` / `wake`, which make room first, under one lock: while
  the book (`used`) plus what the start needs exceeds the budget, the least recently used idle,
  unpinned version with minWorkers 0 is unloaded (`evictions` records the order). Nothing in
  flight is ever cut: a version with requests in flight is not a candidate. If it still cannot
  fit, a request gets NoWorkerError (503) and a registration ModelTooLargeError (507), both
  naming the sizes.
- A request to a version with no ready worker (`ready_worker`) loads one (minWorkers 0) or
  wakes the sleeping ones, and waits within the version's responseTimeout.
- Keep-alive: a version with minWorkers 0 is unloaded `keep_alive` seconds after its last
  request ended (the request's own `keep_alive` when it gave one, Ollama's semantics: 0 unloads
  right after it, a negative value keeps it loaded), unless pinned. A version with minWorkers >
  0 keeps its workers: its minimum is a promise, so it is never evicted nor expired either.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Callable
from datetime import datetime, timedelta, timezone
from typing import TYPE_CHECKING, Any, Literal, Protocol

from pagedserve.server.workers.memory_budget import (
    Footprint,
    MemoryBudget,
    ModelTooLargeError,
    fmt,
    path_sizes,
    version_sizes,
)
from pagedserve.server.workers.pool import NoWorkerError, WorkerSlot, WorkerStartFailed, WorkerStatus

if TYPE_CHECKING:
    from pathlib import Path

    from pagedserve.engine.config.engine import EngineConfig
    from pagedserve.engine.core.async_llm import AsyncLLM
    from pagedserve.server.workers.version import ModelVersion

logger = logging.getLogger(__name__)

REAP_INTERVAL_S = 0.25  # how often expired keep-alives are looked for
SLEEP_TIMEOUT_S = 60.0


class LifecycleConflict(RuntimeError):
    """A sleep that cannot happen (requests in flight, nothing loaded, KV offload on): 409."""


class Registry(Protocol):
    """What the lifecycle reads of the registry that owns it
    (pagedserve.server.workers.registry.ModelRegistry)."""

    @property
    def startup_done(self) -> bool: ...
    def all_versions(self) -> list[ModelVersion]: ...
    def engine_config(self, entry: ModelVersion) -> EngineConfig: ...
    def save_state(self) -> None: ...


class ModelLifecycle:
    """The budget's book and every change that adds or frees a worker's memory."""

    def __init__(
        self,
        registry: Registry,
        budget: MemoryBudget,
        default_keep_alive: float,
        sizes_of: Callable[[ModelVersion], tuple[int, int]] | None = None,
    ) -> None:
        self.registry = registry
        self.budget = budget
        self.default_keep_alive = default_keep_alive
        self._sizes_of = sizes_of or (lambda entry: version_sizes(registry.engine_config(entry)))
        self._lock = asyncio.Lock()  # budget decisions, one at a time
        self._bringing_up: dict[int, asyncio.Task] = {}  # id(version) -> its load / wake
        self._reaper: asyncio.Task | None = None
        self._tasks: set[asyncio.Task] = set()
        self.evictions: list[tuple[str, str, str]] = []  # (model, version, why), in order
        self.progress: Callable[[str], None] | None = None  # start-up progress lines

    # -- the book --------------------------------------------------------------------------
    def sizes(self, entry: ModelVersion) -> tuple[int, int]:
        if entry.sizes is None:
            entry.sizes = self._sizes_of(entry)
        return entry.sizes

    def estimate(self, entry: ModelVersion) -> Footprint:
        """What one more worker of `entry` will take."""
        weights, kv = self.sizes(entry)
        return Footprint(weights, kv, self.budget.overhead_estimate, False)

    def footprint(self, entry: ModelVersion, slot: WorkerSlot) -> Footprint:
        """What a worker counts: awake, weights + KV pool + overhead (measured once it is
        ready); asleep, the memory it measured after falling asleep."""
        if slot.status is WorkerStatus.SLEEPING and slot.sleep_rss is not None:
            return Footprint(0, 0, slot.sleep_rss, True)
        weights, kv = self.sizes(entry)
        if slot.overhead is not None:
            return Footprint(weights, kv, slot.overhead, True)
        return Footprint(weights, kv, self.budget.overhead_estimate, False)

    def charge(self, entry: ModelVersion, slot: WorkerSlot) -> int:
        """A worker's footprint, never less than its RSS right now."""
        from pagedserve.engine.platform.process_setup import resident_bytes

        pid = slot.engine.pid if slot.engine is not None else None
        rss = resident_bytes(pid) if pid is not None else 0
        return max(self.footprint(entry, slot).total, rss)

    def used(self) -> int:
        return sum(
            self.charge(v, s)
            for v in self.registry.all_versions()
            for s in v.pool.slots
            if s.status is not WorkerStatus.STOPPED
        )

    def on_worker_ready(self, entry: ModelVersion, slot: WorkerSlot) -> None:
        """Measure a worker that just became ready: its overhead, the estimate for the next.
        While the server starts, each ready worker is a progress line (`progress`)."""
        weights, kv = self.sizes(entry)
        slot.overhead = self.budget.measure(slot.engine.pid if slot.engine else None, weights, kv)
        slot.sleep_rss = None
        if self.progress is not None and not self.registry.startup_done:
            seconds = (datetime.now(timezone.utc) - slot.start_time).total_seconds()
            self.progress(
                f"pagedserve: worker {slot.id} of {entry.name} {entry.version} ready "
                f"in {seconds:.1f} s ({fmt(self.footprint(entry, slot).total)}; budget "
                f"{fmt(self.used())} of {fmt(self.budget.total)} used)"
            )

    async def restore(self, entry: ModelVersion, state: str, pinned: bool) -> None:
        """Bring a version restored from the snapshot back to its saved state (within the
        budget: a load that does not fit leaves it unloaded, logged)."""
        entry.pinned = pinned
        try:
            if entry.min_workers == 0 and state in ("loaded", "sleeping"):
                await self.start_workers(entry, 1, wait=True)
            if state == "sleeping":
                await self.sleep(entry)
        except (RuntimeError, ModelTooLargeError) as exc:
            logger.error("snapshot: %s %s stays %s: %s", entry.name, entry.version, state_of(entry), exc)

    # -- starting workers ------------------------------------------------------------------
    def check_fits(self, entry: ModelVersion) -> None:
        """ModelTooLargeError when one worker of `entry` is larger than the whole budget."""
        one = self.estimate(entry)
        if one.total > self.budget.total:
            raise ModelTooLargeError(
                f"model {entry.name!r} version {entry.version!r} needs {fmt(one.total)} per worker "
                f"(weights {fmt(one.weights)} + KV pool {fmt(one.kv_pool)} + overhead "
                f"{fmt(one.overhead)}), more than the whole memory budget of "
                f"{fmt(self.budget.total)}"
            )

    def check_path_fits(self, path: Path) -> None:
        """ModelTooLargeError when one worker of the archive a .gguf file or model folder would
        become is larger than the whole budget: checked before the archive is built (a GGUF is
        not de-quantized, a folder not copied, for a model that can never load). Such an
        archive has no model-config, so its workers take the engine's defaults."""
        from pagedserve.engine.config.engine import EngineConfig

        weights, kv, source = path_sizes(path, EngineConfig(model=str(path)))
        overhead = self.budget.overhead_estimate
        total = weights + kv + overhead
        if total > self.budget.total:
            raise ModelTooLargeError(
                f"model {path.name} needs about {fmt(total)} per worker (weights {fmt(weights)} + KV pool "
                f"{fmt(kv)} + overhead {fmt(overhead)}, estimated from {source} before converting it), "
                f"more than the whole memory budget of {fmt(self.budget.total)}"
            )

    async def start_workers(self, entry: ModelVersion, n: int, *, wait: bool, for_request: bool = False) -> None:
        """Reach `n` workers for `entry`, making room first (LRU eviction) for the new ones.
        Scaling down is the pool's job alone (it frees memory)."""
        self.check_fits(entry)
        async with self._lock:
            missing = n - entry.pool.size
            if missing <= 0:
                start = None
            else:
                await self._make_room(entry, missing * self.estimate(entry).total, for_request)
                start = entry.pool.add_workers(missing, give_up=wait)  # counted from here on
        if start is None:
            await entry.pool.scale_to(n, wait=wait)
        elif wait:
            await entry.pool.wait_started(start)

    async def _make_room(self, entry: ModelVersion, need: int, for_request: bool) -> None:
        while (used := self.used()) + need > self.budget.total:
            victim = self._lru_victim(exclude=entry)
            if victim is None:
                message = (
                    f"model {entry.name!r} version {entry.version!r} needs {fmt(need)} "
                    f"but only {fmt(max(0, self.budget.total - used))} of the "
                    f"{fmt(self.budget.total)} memory budget is free, and no idle, "
                    "unpinned version with minWorkers 0 can be unloaded to make room"
                )
                raise NoWorkerError(message) if for_request else ModelTooLargeError(message)
            await self.unload(victim, f"LRU: room for {entry.name} {entry.version}")

    def _lru_victim(self, exclude: ModelVersion) -> ModelVersion | None:
        candidates = [
            v
            for v in self.registry.all_versions()
            if v is not exclude
            and v.min_workers == 0
            and not v.pinned
            and v.in_flight == 0
            and v.pool.slots
            and id(v) not in self._bringing_up
            and not any(s.status is WorkerStatus.STARTING for s in v.pool.slots)
        ]
        return min(candidates, key=lambda v: v.last_used, default=None)

    async def unload(self, entry: ModelVersion, why: str) -> None:
        """Stop every worker of `entry` (its requests, if any, finish first)."""
        logger.info("unloading %s %s (%s)", entry.name, entry.version, why)
        self.evictions.append((entry.name, entry.version, why))
        entry.expires_at = None
        await entry.pool.scale_to(0, wait=True)
        self.registry.save_state()

    # -- requests --------------------------------------------------------------------------
    async def ready_worker(self, entry: ModelVersion) -> AsyncLLM:
        """A ready worker of `entry` (for its limits), loading or waking one first when none is,
        within the version's responseTimeout (NoWorkerError with the reason otherwise)."""
        if entry.pool.ready_engines():
            return self._any_ready(entry)
        task = self._bringing_up.get(id(entry))
        if task is None:
            task = asyncio.get_running_loop().create_task(self._bring_up(entry))
            self._bringing_up[id(entry)] = task
            task.add_done_callback(lambda _: self._bringing_up.pop(id(entry), None))
        timeout = float(entry.model_config.response_timeout)
        try:
            await asyncio.wait_for(asyncio.shield(task), timeout)
        except asyncio.TimeoutError:
            raise NoWorkerError(
                f"model {entry.name!r} version {entry.version!r} is still loading after {timeout:g} s (responseTimeout)"
            ) from None
        except (WorkerStartFailed, RuntimeError) as exc:
            if isinstance(exc, NoWorkerError):
                raise
            raise NoWorkerError(f"model {entry.name!r} version {entry.version!r} could not be loaded: {exc}") from None
        return self._any_ready(entry)

    @staticmethod
    def _any_ready(entry: ModelVersion) -> AsyncLLM:
        """One ready worker (its limits are every worker's): the router picks the one that
        serves the request later, once the prompt is tokenized (pagedserve.server.workers.routing)."""
        ready = entry.pool.ready_engines()
        if not ready:
            raise NoWorkerError(
                f"model {entry.name!r} version {entry.version!r} has no ready worker right now; retry shortly"
            )
        return ready[0]

    async def _bring_up(self, entry: ModelVersion) -> None:
        if entry.pool.sleeping_slots():
            await self.wake(entry, for_request=True)
        elif entry.pool.size == 0:
            await self.start_workers(entry, 1, wait=True, for_request=True)
            self.registry.save_state()
        while not entry.pool.ready_engines():  # workers starting: wait for one
            slots = entry.pool.active_slots()
            if not slots:
                raise RuntimeError("its workers were stopped while it loaded")
            if all(s.start_failed for s in slots):  # no start is expected to succeed: a
                # broken model in a start-failure loop; answer now (503). A restart after a
                # crash is waited for like a load.
                raise NoWorkerError(
                    f"model {entry.name!r} version {entry.version!r} has no "
                    f"ready worker (last error: {slots[0].last_error}); retry shortly"
                )
            await asyncio.sleep(0.05)

    def on_idle(self, entry: ModelVersion, keep_alive: float | None) -> None:
        """The version's last request in flight ended: set its keep-alive expiry."""
        if entry.min_workers > 0 or entry.pinned:
            entry.expires_at = None
            return
        seconds = keep_alive if keep_alive is not None else self.keep_alive_of(entry)
        entry.expires_at = None if seconds < 0 else time.monotonic() + seconds
        if entry.expires_at is not None:
            self._ensure_reaper()

    def keep_alive_of(self, entry: ModelVersion) -> float:
        return entry.keep_alive if entry.keep_alive is not None else self.default_keep_alive

    def _ensure_reaper(self) -> None:
        if self._reaper is None or self._reaper.done():
            self._reaper = asyncio.get_running_loop().create_task(self._reap())

    async def _reap(self) -> None:
        while True:
            now = time.monotonic()
            for v in self.registry.all_versions():
                if (
                    v.expires_at is not None
                    and now >= v.expires_at
                    and v.in_flight == 0
                    and not v.pinned
                    and v.min_workers == 0
                    and id(v) not in self._bringing_up
                ):
                    if v.pool.slots:
                        async with self._lock:
                            if v.in_flight == 0 and v.expires_at is not None:
                                await self.unload(v, "keep-alive expired")
                    v.expires_at = None
            await asyncio.sleep(REAP_INTERVAL_S)

    # -- sleep and wake --------------------------------------------------------------------
    async def sleep(self, entry: ModelVersion) -> None:
        """Free the weights and KV pools of the version's workers, keeping the processes."""
        async with self._lock:
            if entry.in_flight:
                raise LifecycleConflict(
                    f"model {entry.name!r} version {entry.version!r} has "
                    f"{entry.in_flight} requests in flight; retry when idle"
                )
            slots = [s for s in entry.pool.slots if s.is_ready]
            if not slots:
                if entry.pool.sleeping_slots():
                    return
                raise LifecycleConflict(
                    f"model {entry.name!r} version {entry.version!r} has no loaded worker to put to sleep"
                )
            answers = await asyncio.gather(
                *(s.started_engine().sleep(SLEEP_TIMEOUT_S) for s in slots), return_exceptions=True
            )
            failed = []
            for slot, answer in zip(slots, answers):
                if isinstance(answer, BaseException):  # busy after all, or KV offload on
                    failed.append(f"worker {slot.id}: {answer}")
                    continue
                slot.status = WorkerStatus.SLEEPING
                slot.sleep_rss = answer.rss_bytes
            entry.expires_at = None
        self.registry.save_state()
        if failed:
            raise LifecycleConflict(
                f"model {entry.name!r} version {entry.version!r}: "
                f"{len(failed)} of {len(slots)} workers did not sleep ("
                f"{'; '.join(failed)})"
            )

    async def wake(self, entry: ModelVersion, *, for_request: bool = False) -> None:
        """Load the sleeping workers' weights and KV pools again (room made first)."""
        async with self._lock:
            slots = entry.pool.sleeping_slots()
            if not slots:
                return
            weights, kv = self.sizes(entry)
            await self._make_room(entry, len(slots) * (weights + kv), for_request)
            for slot in slots:  # counted awake from here on
                slot.status = WorkerStatus.STARTING
                slot.sleep_rss = None
        answers = await asyncio.gather(*(s.started_engine().wake() for s in slots), return_exceptions=True)
        for slot, answer in zip(slots, answers):
            if isinstance(answer, BaseException):
                logger.error(
                    "worker %s of %s %s did not wake: %s; restarting it", slot.id, entry.name, entry.version, answer
                )
                entry.pool.restart(slot)
            else:
                slot.status = WorkerStatus.READY
        self.registry.save_state()
        entry.pool.changed()

    # -- describing and closing ------------------------------------------------------------
    def describe(self, entry: ModelVersion) -> dict[str, Any]:
        expires = None
        if entry.expires_at is not None:
            wall = datetime.now(timezone.utc) + timedelta(seconds=entry.expires_at - time.monotonic())
            expires = wall.isoformat(timespec="milliseconds").replace("+00:00", "Z")
        return {
            "state": state_of(entry),
            "pinned": entry.pinned,
            "keepAlive": self.keep_alive_of(entry),
            "expiresAt": expires,
        }

    def describe_worker(self, entry: ModelVersion, slot: WorkerSlot) -> dict[str, Any]:
        return self.footprint(entry, slot).as_json()

    async def close(self) -> None:
        if self._reaper is not None:
            self._reaper.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._reaper
        for task in list(self._bringing_up.values()):
            task.cancel()


def state_of(entry: ModelVersion) -> Literal["unloaded", "loading", "loaded", "sleeping"]:
    """unloaded, loading, loaded or sleeping."""
    pool = entry.pool
    if pool.sleeping_slots():
        return "sleeping"
    if pool.ready_engines():
        return "loaded"
    if pool.size:
        return "loading"
    return "unloaded"


class BudgetCollector:
    """Prometheus gauges of the memory budget, read at scrape time."""

    def __init__(self, lifecycle: ModelLifecycle) -> None:
        self._lifecycle = lifecycle

    def describe(self) -> list:
        return []

    def collect(self):
        from prometheus_client.core import GaugeMetricFamily

        total = self._lifecycle.budget.total
        used = self._lifecycle.used()
        for name, doc, value in (
            ("pagedserve_memory_budget_bytes", "The memory budget of all workers", total),
            (
                "pagedserve_memory_budget_used_bytes",
                "Memory the workers count against the budget (footprints, at least their RSS)",
                used,
            ),
            ("pagedserve_memory_budget_free_bytes", "Budget left for more workers", max(0, total - used)),
        ):
            family = GaugeMetricFamily(name, doc)
            family.add_metric([], value)
            yield family
