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
import contextlib
import itertools
import logging
import os
import re
import time
from collections.abc import Callable, Iterator, Sequence
from concurrent.futures import Executor
from dataclasses import dataclass, field
from datetime import datetime, timezone
from pathlib import Path
from typing import TYPE_CHECKING, Any

import msgspec

from pagedserve.engine.model.model_config import ModelConfig
from pagedserve.engine.model.path_source import is_model_path
from pagedserve.handlers.base_handler import BaseHandler, Context
from pagedserve.handlers.custom_handler import CustomHandlerError
from pagedserve.handlers.llm_handler import ENGINE_WORKERS
from pagedserve.server.common.safe_write import NO_SPACE
from pagedserve.server.workers.archives import LoadedArchive, load_archive
from pagedserve.server.workers.lifecycle import ModelLifecycle
from pagedserve.server.workers.memory_budget import MemoryBudget, ModelTooLargeError, resolve_budget
from pagedserve.server.workers.params import MAX_TIMEOUT_S, MAX_WORKERS
from pagedserve.server.workers.pool import NoWorkerError, WorkerPool
from pagedserve.server.workers.routing import Router

if TYPE_CHECKING:
    from pagedserve.engine.config.engine import EngineConfig
    from pagedserve.engine.core.async_llm import AsyncLLM

logger = logging.getLogger(__name__)

MAX_NAME_LENGTH = 128  # a name must fit in a URL path, well under the 8 KiB header limit
# TorchServe's characters; a name starts with a letter, a version with a letter or digit.
# \Z, not $: "$" would accept a trailing newline.
NAME_PATTERN = r"^[A-Za-z][A-Za-z0-9_.\-]*\Z"
VERSION_PATTERN = r"^[A-Za-z0-9][A-Za-z0-9_.\-]*\Z"


class InvalidNameError(ValueError):
    """A model name or version that breaks the naming rule (400, naming the field)."""


class ModelNotFoundError(LookupError):
    """No such model or version (404); the message names it."""


class QueueFullError(RuntimeError):
    """The version's jobQueueSize is reached (503 with Retry-After)."""


class ConflictError(RuntimeError):
    """The model version is already registered (409)."""


class ForbiddenError(RuntimeError):
    """An operation TorchServe forbids, e.g. removing the default version of a model (403)."""


class SaveFailedError(RuntimeError):
    """The change could not be saved and was undone: 507 when the disk is full, else 500."""

    def __init__(self, cause: OSError) -> None:
        super().__init__(f"{cause.strerror or cause}; the change was not made")
        self.status = 507 if cause.errno in NO_SPACE else 500


def check_model_name(name: object, what: str = "model name") -> str:
    """A model name usable in URLs; ValueError naming the rule otherwise."""
    return _check_name(name, what, NAME_PATTERN, "start with a letter")


def check_version(version: object, what: str = "model version") -> str:
    return _check_name(version, what, VERSION_PATTERN, "start with a letter or digit")


def _check_name(value: object, what: str, pattern: str, start: str) -> str:
    if not isinstance(value, str) or len(value) > MAX_NAME_LENGTH or not re.match(pattern, value):
        shown = repr(value) if len(repr(value)) <= 40 else repr(value)[:37] + "..."
        raise ValueError(
            f"{what} {shown} is not allowed: it must {start}, hold only letters, "
            f"digits, '_', '-' and '.', and be at most {MAX_NAME_LENGTH} characters"
        )
    return value


def check_worker_counts(min_workers: int, max_workers: int, limit_name: str = "max_worker") -> None:
    """min <= max <= MAX_WORKERS; ValueError naming both otherwise."""
    if min_workers < 0:
        raise ValueError(f"min_worker: must be >= 0, got {min_workers}")
    if min_workers > max_workers:
        raise ValueError(f"min_worker: {min_workers} must not exceed {limit_name}: {max_workers}")
    if max_workers > MAX_WORKERS:
        raise ValueError(f"max_worker: must be <= {MAX_WORKERS} (workers per version), got {max_workers}")


def check_timeout(what: str, seconds: float | None) -> None:
    if seconds is not None and seconds > MAX_TIMEOUT_S:
        raise ValueError(f"{what}: must be <= {MAX_TIMEOUT_S} seconds, got {seconds}")


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

    def pick_worker(self, token_ids: Sequence[int] = ()) -> AsyncLLM:
        """The ready worker the version's router picks for a prompt of `token_ids` (least
        loaded, or the one that holds the prompt's prefix: `pagedserve.server.workers.routing`)."""
        engine = self.router.route(self._ready(), token_ids).engine
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


# make_engine(model_version, worker_name, on_dead) -> a not-started AsyncLLM
EngineBuilder = Callable[[ModelVersion, str, Callable[["AsyncLLM"], None]], "AsyncLLM"]


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
    ) -> None:
        self._executor = executor
        self._make_engine = make_engine
        self.allow_custom_handlers = allow_custom_handlers
        self.default_workers = default_workers
        self.job_queue_size = job_queue_size
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
            tokenizer = await loop.run_in_executor(self._executor, _load_tokenizer, archive.model_dir)
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
                router=Router(config.routing, block_size=config.engine_options().get("block_size", 16)),
            )
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

    def save_change(self, undo: Callable[[], None] | None) -> None:
        """Persist a change made beside the registry (a LoRA adapter registered or removed)."""
        self._save(undo)

    def _save(self, undo: Callable[[], None] | None) -> None:
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

    def _default_workers(self, archive: LoadedArchive) -> int:
        if "minWorkers" in archive.config_keys or self.default_workers is None:
            return archive.model_config.min_workers
        return self.default_workers


def _initialize_handler(handler: BaseHandler, context: Context) -> None:
    try:
        handler.initialize(context)
    except Exception as exc:  # their code: refuse the registration and say why
        raise CustomHandlerError(f"the custom handler's initialize failed: {type(exc).__name__}: {exc}") from exc


def _load_tokenizer(model_dir: Path):
    from pagedserve.engine.llm import load_tokenizer

    return load_tokenizer(model_dir)


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
