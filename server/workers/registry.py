"""The model registry: models -> versions -> workers, with a default version per model.

`ModelRegistry` is what the HTTP apps see: `resolve` a (model, version) to a `ModelVersion`,
whose `pick_worker` routes by the version's `routing` policy (`pagedserve.server.workers.routing`: least loaded, or
prefix-affine) and whose `admit` bounds the number
of requests in flight (`jobQueueSize`). Registration opens the archive and loads the tokenizer
off the event loop, then starts the version's workers (`pagedserve.server.workers.pool.WorkerPool`).

Every change (register, unregister, scale, set-default) is checked here, whoever asks (the
management API or the snapshot restore): names and versions follow TorchServe's characters and
`MAX_NAME_LENGTH`, worker counts stay within the version's maxWorkers, timeouts within
`MAX_TIMEOUT_S`. Each change is then saved (`persist`, the snapshot) before it takes effect;
when the save fails the change is undone and `SaveFailedError` raised, so that the live state and
the saved one never differ.
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import os
import sys
import time
from collections.abc import Callable
from concurrent.futures import Executor
from pathlib import Path
from typing import TYPE_CHECKING, Any

import msgspec

from pagedserve.engine.config.kv_offload import DEFAULT_CHUNK_SIZE
from pagedserve.engine.model.model_config import ModelConfig
from pagedserve.engine.model.path_source import is_model_path
from pagedserve.engine.model.tokenizer import load_tokenizer
from pagedserve.handlers.base_handler import BaseHandler, Context
from pagedserve.handlers.custom_handler import CustomHandlerError
from pagedserve.handlers.llm_handler import ENGINE_WORKERS
from pagedserve.server.workers.archives import LoadedArchive, load_archive
from pagedserve.server.workers.disagg import DisaggRouter, is_disaggregated
from pagedserve.server.workers.lifecycle import ModelLifecycle
from pagedserve.server.workers.memory_budget import MemoryBudget, ModelTooLargeError, resolve_budget
from pagedserve.server.workers.pool import WorkerPool
from pagedserve.server.workers.routing import Router, RoutingPolicy
from pagedserve.server.workers.rules import (
    ConflictError,
    ForbiddenError,
    InvalidNameError,
    ModelNotFoundError,
    SaveFailedError,
    check_model_name,
    check_timeout,
    check_version,
    check_worker_counts,
)
from pagedserve.server.workers.version import EngineBuilder, ModelVersion, RegisteredModel

if TYPE_CHECKING:
    from pagedserve.engine.config.engine import EngineConfig
    from pagedserve.engine.core.async_llm import AsyncLLM

logger = logging.getLogger(__name__)


class ModelRegistry:
    """Every registered model. All methods run on the event loop."""

    def __init__(
        self,
        executor: Executor,
        make_engine: EngineBuilder,
        *,
        allow_custom_handlers: bool = False,
        default_workers: int | None = None,
        job_queue_size: int = 100,
        on_change: Callable[[], None] | None = None,
        persist: Callable[[], None] | None = None,
        memory_budget: int | str | None = None,
        keep_alive: float = 300.0,
        kv_offload: dict[str, Any] | None = None,
    ) -> None:
        self._executor = executor
        self._make_engine = make_engine
        self.allow_custom_handlers = allow_custom_handlers
        self.default_workers = default_workers
        self.job_queue_size = job_queue_size
        self.kv_offload = kv_offload  # the server-wide kv_offload a model without its own inherits
        self.on_change = on_change or (lambda: None)  # after any change, workers' included
        # Saves the registry (the snapshot); raises OSError when it cannot. None: nothing saved.
        self.persist = persist
        self._background: set[asyncio.Task] = set()  # scalings a caller stopped waiting for
        self.models: dict[str, RegisteredModel] = {}
        self._worker_ids = itertools.count(9000)  # TorchServe numbers its workers from 9000
        self._lock = asyncio.Lock()  # registrations and removals, one at a time
        # False until the server has registered its startup models (snapshot, load_models).
        self.startup_done = False
        self.lifecycle = ModelLifecycle(self, MemoryBudget(resolve_budget(memory_budget)), keep_alive)

    # -- lookups (the inference app's side) ---------------------------------------------
    def resolve(self, name: str, version: str | None = None) -> ModelVersion:
        """The version `name` (and `version`, else the default) names; ModelNotFoundError, or
        InvalidNameError (a ValueError: 400) for a name no registration could have."""
        for value, what, check in ((name, "model", check_model_name), (version, "version", check_version)):
            if value is not None:
                try:
                    check(value, what)
                except ValueError as exc:
                    raise InvalidNameError(str(exc)) from None
        model = self.models.get(name)
        if model is None or not model.versions:
            raise ModelNotFoundError(f"Model not found: {name}")
        key = version if version is not None else model.default_version
        found = model.versions.get(key) if key is not None else None
        if found is None:
            raise ModelNotFoundError(f"Model version: {version} does not exist for model: {name}")
        return found

    def all_versions(self) -> list[ModelVersion]:
        return [v for m in self.sorted_models() for v in m.versions.values()]

    def sorted_models(self) -> list[RegisteredModel]:
        return [self.models[n] for n in sorted(self.models)]

    def total_workers(self) -> int:
        return sum(v.pool.size for v in self.all_versions())

    async def ready_worker(self, entry: ModelVersion) -> AsyncLLM:
        """A ready worker of `entry`; one is loaded or woken first when none is (the request
        waits within the version's responseTimeout; NoWorkerError naming why otherwise)."""
        return await self.lifecycle.ready_worker(entry)

    def engine_config(self, entry: ModelVersion) -> EngineConfig:
        """The EngineConfig a worker of `entry` gets (from the server's engine builder)."""
        return self._make_engine(entry, f"{entry.name}/{entry.version}#config", lambda e: None).config

    def save_state(self) -> None:
        """Save a lifecycle change (loaded, unloaded, asleep); a failure is only logged: the
        memory has changed whatever the file says."""
        self._save(None)

    # -- changes (the management app's side) --------------------------------------------
    async def open(self, path: Path, chat_template: str | None = None) -> LoadedArchive:
        """Verify and extract the archive off the event loop (a .gguf file or a model folder:
        archived first, with `chat_template` when given, once the budget can hold a worker of
        it: ModelTooLargeError otherwise)."""
        loop = asyncio.get_running_loop()
        if is_model_path(path):
            await loop.run_in_executor(self._executor, self.lifecycle.check_path_fits, path)
        return await loop.run_in_executor(self._executor, load_archive, path, self.allow_custom_handlers, chat_template)

    async def register(
        self,
        archive: LoadedArchive,
        *,
        url: str,
        name: str | None = None,
        initial_workers: int | None = None,
        max_workers: int | None = None,
        synchronous: bool = True,
        loaded_at_startup: bool = False,
        make_default: bool = False,
        response_timeout: int | None = None,
    ) -> ModelVersion:
        """Add a version and start its workers. With `synchronous`, return once they are ready
        (WorkerStartFailed: the version is removed again); otherwise they start in the
        background. ConflictError if that version is registered already; ValueError for a bad
        name, version, worker count or timeout; SaveFailedError when it could not be saved."""
        name = check_model_name(name or archive.name)
        version = check_version(archive.version)
        config = archive.model_config
        min_workers = initial_workers if initial_workers is not None else self._default_workers(archive)
        if max_workers is not None:
            check_worker_counts(min_workers, max_workers)
            max_w = max_workers
        elif "maxWorkers" in archive.config_keys and initial_workers is not None:
            check_worker_counts(min_workers, config.max_workers, "the archive's maxWorkers")
            max_w = config.max_workers
        else:  # no maximum was set: it follows the number of workers asked for
            max_w = max(config.max_workers, min_workers)
            check_worker_counts(min_workers, max_w)
        if response_timeout is not None:
            check_timeout("response_timeout", response_timeout)
            config = msgspec.structs.replace(config, response_timeout=response_timeout)
        check_timeout("responseTimeout", config.response_timeout)
        async with self._lock:
            model = self.models.get(name)
            if model is not None and version in model.versions:
                raise ConflictError(f"Model version {version} is already registered for model {name}")
            loop = asyncio.get_running_loop()
            tokenizer = await loop.run_in_executor(self._executor, load_tokenizer, archive.model_dir)
            queue = config.job_queue_size if "jobQueueSize" in archive.config_keys else self.job_queue_size
            context = Context(
                model_name=name,
                model_dir=archive.model_dir,
                manifest=archive.manifest,
                model_config=config,
                system_properties={
                    "device": config.device_type.value if config.device_type else "cpu",
                    "engine": ENGINE_WORKERS,
                },
            )
            if archive.handler is not None:
                await loop.run_in_executor(self._executor, _initialize_handler, archive.handler, context)
            entry = ModelVersion(
                name=name,
                version=version,
                model_dir=archive.model_dir,
                context=context,
                tokenizer=tokenizer,
                archive=archive,
                url=url,
                pool=None,  # type: ignore[arg-type]
                min_workers=min_workers,
                max_workers=max_w,
                job_queue_size=queue,
                loaded_at_startup=loaded_at_startup,
                handler=archive.handler,
                router=Router(RoutingPolicy(config.routing), block_size=config.engine_options().get("block_size", 16)),
            )
            entry.disagg = self._disagg_router(config, entry.router)
            entry.pool = WorkerPool(
                f"{name}/{version}",
                lambda worker_name, on_dead: self._make_engine(entry, worker_name, on_dead),
                lambda: str(next(self._worker_ids)),
                startup_timeout=float(config.startup_timeout),
                on_change=lambda: self.on_change(),
                on_ready=lambda slot: self.lifecycle.on_worker_ready(entry, slot),
            )
            entry.keep_alive = config.keep_alive
            entry.on_idle = self.lifecycle.on_idle
            entry.last_used = time.monotonic()
            await loop.run_in_executor(self._executor, self.lifecycle.sizes, entry)
            self.lifecycle.check_fits(entry)  # ModelTooLargeError (507): never fits the budget
            model = self.models.setdefault(name, RegisteredModel(name))
            old_default = model.default_version
            model.versions[version] = entry
            if model.default_version is None or make_default:
                model.default_version = version

            def undo() -> None:
                del model.versions[version]
                model.default_version = old_default
                if not model.versions:
                    del self.models[name]

            self._save(undo)
        try:
            await self.lifecycle.start_workers(entry, min_workers, wait=synchronous)
        except Exception:
            await self.unregister(name, version, force=True)
            raise
        return entry

    async def unregister(self, name: str, version: str | None = None, *, force: bool = False) -> ModelVersion:
        """Remove one version (the default one when `version` is None) and stop its workers.
        The default version cannot go while others remain (ForbiddenError), as in TorchServe.
        `force` (a registration taking itself back) skips that rule and removes the version
        even when the save fails."""
        async with self._lock:
            entry = self.resolve(name, version)
            model = self.models[name]
            if not force and entry.version == model.default_version and len(model.versions) > 1:
                raise ForbiddenError(
                    f"Can't remove default version: {entry.version} of model {name}; set another default version first"
                )
            old_default = model.default_version
            del model.versions[entry.version]
            if not model.versions:
                del self.models[name]
            elif model.default_version == entry.version:
                model.default_version = max(model.versions, key=_version_key)

            def undo() -> None:
                model.versions[entry.version] = entry
                model.default_version = old_default
                self.models[name] = model

            self._save(None if force else undo)
        await entry.pool.shutdown()
        return entry

    async def scale(
        self,
        entry: ModelVersion,
        min_workers: int,
        max_workers: int | None = None,
        *,
        synchronous: bool,
        timeout: float | None = None,
    ) -> bool:
        """Set the version's worker range and reach `min_workers`. `max_workers` None keeps the
        version's maxWorkers, which `min_workers` must not exceed (ValueError naming both).
        With `synchronous`, wait up to `timeout` seconds (None or < 0: no limit) for the workers;
        False when that ran out (the scaling goes on)."""
        max_w = entry.max_workers if max_workers is None else max_workers
        check_worker_counts(min_workers, max_w, "max_worker" if max_workers is not None else "maxWorkers")
        check_timeout("timeout", timeout)
        old = (entry.min_workers, entry.max_workers)
        entry.min_workers, entry.max_workers = min_workers, max_w

        def undo() -> None:
            entry.min_workers, entry.max_workers = old

        self._save(undo)

        async def reach() -> None:  # new workers within the budget (room made first)
            try:
                await self.lifecycle.start_workers(entry, min_workers, wait=synchronous)
            except ModelTooLargeError:
                undo()
                self._save(None)
                raise

        work = asyncio.ensure_future(reach())
        self._background.add(work)
        work.add_done_callback(self._background.discard)
        if not synchronous:
            await work  # new workers are starting, removed ones unloading
            return True
        try:
            await asyncio.wait_for(asyncio.shield(work), None if timeout is None or timeout < 0 else timeout)
        except asyncio.TimeoutError:
            return False
        return True

    def set_pinned(self, entry: ModelVersion, pinned: bool) -> None:
        """Pin (never unloaded by keep-alive or LRU eviction) or unpin a version; saved."""
        old = entry.pinned
        entry.pinned = pinned
        self._save(lambda: setattr(entry, "pinned", old))
        if entry.in_flight == 0:  # pinned: no expiry; unpinned: its keep-alive counts from now
            self.lifecycle.on_idle(entry, None)

    def set_default(self, name: str, version: str) -> ModelVersion:
        entry = self.resolve(name, version)
        model = self.models[name]
        old_default = model.default_version
        model.default_version = entry.version
        self._save(lambda: setattr(model, "default_version", old_default))
        return entry

    def save_change(self, undo: Callable[[], object] | None) -> None:
        """Persist a change made beside the registry (a LoRA adapter registered or removed)."""
        self._save(undo)

    def _save(self, undo: Callable[[], object] | None) -> None:
        """Persist a change just made in memory. If that fails, `undo` it and raise
        SaveFailedError (`undo` None: keep it, and log that the snapshot is behind)."""
        if self.persist is not None:
            try:
                self.persist()
            except OSError as exc:
                if undo is None:
                    logger.error(
                        "%s; the live registry has moved on and the saved one is behind until the next save",
                        exc.strerror or exc,
                    )
                else:
                    undo()
                    raise SaveFailedError(exc) from exc
        self.on_change()

    async def shutdown(self) -> None:
        await self.lifecycle.close()
        versions = self.all_versions()
        await asyncio.gather(*(v.pool.shutdown() for v in versions), return_exceptions=True)

    def _disagg_router(self, config: ModelConfig, router: Router) -> DisaggRouter | None:
        """The prefill/decode router of a version whose workerRoles list prefill workers; they
        hand KV over through kv_offload, so it must be on (ValueError naming workerRoles)."""
        if not is_disaggregated(config.worker_roles):
            return None
        offload = config.handler.get("kv_offload")
        if (
            offload is None
            and self.kv_offload is not None
            and config.engine_options().get("tensor_parallel_size", 1) == 1
        ):
            offload = self.kv_offload
        if offload is None:
            raise ValueError(
                "workerRoles: prefill workers hand the prompt's KV to decode workers through the KV "
                "offload connector: set handler.kv_offload (a disk_path both workers share, or a "
                "remote_url) or the server's kv_offload"
            )
        block_size = config.engine_options().get("block_size", 16)
        chunk = dict(offload).get("chunk_size", DEFAULT_CHUNK_SIZE)
        return DisaggRouter(
            list(config.worker_roles or ()),
            decode_router=router,
            prefill_router=Router(RoutingPolicy(config.routing), block_size=block_size),
            chunk_size=chunk,
            block_size=block_size,
            retry_wait_s=float(config.response_timeout),
        )

    def _default_workers(self, archive: LoadedArchive) -> int:
        if "minWorkers" in archive.config_keys or self.default_workers is None:
            return archive.model_config.min_workers
        return self.default_workers


def _initialize_handler(handler: BaseHandler, context: Context) -> None:
    try:
        handler.initialize(context)
    except Exception as exc:  # their code: refuse the registration and say why
        raise CustomHandlerError(f"the custom handler's initialize failed: {type(exc).__name__}: {exc}") from exc
    torch = sys.modules.get("torch")
    if torch is not None:  # their code brought torch into the front end: one thread, as the rest here
        torch.set_num_threads(1)


def _version_key(version: str) -> tuple:
    parts = []
    for part in version.replace("-", ".").split("."):
        parts.append((0, int(part), "") if part.isdigit() else (1, 0, part))
    return tuple(parts)


def worker_threads(configured: int | None, total_workers: int) -> int:
    """Torch threads per worker: the configured number, else the cores shared evenly."""
    if configured is not None:
        return configured
    return max(1, (os.cpu_count() or 1) // max(1, total_workers))
