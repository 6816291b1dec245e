"""The management port: TorchServe's management API (register, list, describe, scale,
set-default, unregister, key rotation with /token) with its parameters, status codes and JSON
shapes, and its OpenAPI description (`OPTIONS /`, `GET /api-description`).

Registration and unregistration answer 405 unless the model API is enabled
(`--enable-model-api`). Errors are `{"code", "type", "message"}`, made in one middleware
(pagedserve.server.serving.middleware) from the exceptions the routes raise (`EXCEPTION_CODES`).
"""

from __future__ import annotations

import dataclasses
import os
from collections.abc import Callable, Iterable
from operator import attrgetter
from pathlib import Path
from typing import Any

import msgspec
from aiohttp import web

from pagedserve.engine.config.schema import SchemaError
from pagedserve.engine.model.archive_manifest import BUILTIN_HANDLERS, ArchiveError
from pagedserve.engine.model.model_config import ModelConfigError
from pagedserve.engine.model.path_source import describe_model as describe_model_dir
from pagedserve.engine.model.path_source import is_model_path
from pagedserve.handlers.base_handler import HandlerError
from pagedserve.handlers.json_body import decode_json_body
from pagedserve.server.common import openapi
from pagedserve.server.common.auth import Api, auth_middleware
from pagedserve.server.common.errors import error_body
from pagedserve.server.console import app as console
from pagedserve.server.management.lifecycle_routes import ROUTES as LIFECYCLE_ROUTES
from pagedserve.server.serving.body_encoding import decode_body_middleware
from pagedserve.server.serving.generation import ErrorReply
from pagedserve.server.serving.middleware import drain_middleware, error_middleware
from pagedserve.server.serving.state import STATE_KEY, ServerState
from pagedserve.server.workers.adapters import is_adapter
from pagedserve.server.workers.archives import ArchiveNotFoundError, LoadedArchive, UrlNotAllowedError, resolve_url
from pagedserve.server.workers.disagg import slot_role
from pagedserve.server.workers.lifecycle import LifecycleConflict, ModelLifecycle
from pagedserve.server.workers.memory_budget import ModelTooLargeError
from pagedserve.server.workers.params import (
    MAX_PAGE,
    ListParams,
    RegisterParams,
    ScaleParams,
    TokenParams,
    UnregisterParams,
    read_params,
)
from pagedserve.server.workers.pool import NoWorkerError, WorkerStartFailed
from pagedserve.server.workers.rules import ConflictError, ForbiddenError, ModelNotFoundError, SaveFailedError
from pagedserve.server.workers.version import ModelVersion


async def _register_params(request: web.Request) -> RegisterParams:
    """The query string, or a JSON body (TorchServe accepts both)."""
    params: dict[str, Any] = dict(request.query)
    body = await request.read()
    if body.strip():
        try:
            params.update(decode_json_body(body))
        except HandlerError as exc:
            raise SchemaError(str(exc), exc.param) from None
    return read_params(params, RegisterParams)


# -- describing ---------------------------------------------------------------------------
def _memory_usage(pid: int | None) -> int:
    """Resident bytes of a worker process (Linux /proc), 0 when unknown."""
    if pid is None:
        return 0
    try:
        pages = int(Path(f"/proc/{pid}/statm").read_text().split()[1])
    except (OSError, ValueError, IndexError):
        return 0
    return pages * os.sysconf("SC_PAGE_SIZE")


def describe(entry: ModelVersion, is_default: bool, lifecycle: ModelLifecycle) -> dict[str, Any]:
    config = entry.model_config
    workers = []
    for slot in entry.pool.slots:
        engine = slot.engine
        pid = engine.pid if engine is not None else None
        workers.append(
            {
                "id": slot.id,
                "startTime": slot.start_time.isoformat(timespec="milliseconds").replace("+00:00", "Z"),
                "status": slot.status.value,
                "memoryUsage": _memory_usage(pid),
                "pid": pid if pid is not None else -1,
                "gpu": bool(engine is not None and str(engine.config.device).startswith("cuda")),
                "gpuUsage": "N/A",
                "deviceIds": list(slot.devices),  # its GPUs (server/workers/devices.py); [] on the CPU
                "restarts": slot.restarts,
                "role": slot_role(config.worker_roles, slot.index).value,  # prefill, decode or both
                "threads": (engine.stats.num_threads or engine.num_threads) if engine is not None else None,
                "lastError": slot.last_error,
                "requestsInFlight": engine.num_unfinished if engine is not None and engine.is_ready else 0,
                "footprint": lifecycle.describe_worker(entry, slot),
            }
        )
    running = sum(e.stats.num_running for e in entry.pool.ready_engines())
    info = next((e.info for e in entry.pool.ready_engines() if e.info is not None), None)
    return {
        "modelName": entry.name,
        "modelVersion": entry.version,
        "modelUrl": entry.url,
        "runtime": "python",
        "minWorkers": entry.min_workers,
        "maxWorkers": entry.max_workers,
        "batchSize": 1,
        "maxBatchDelay": 0,
        "responseTimeout": config.response_timeout,
        "startupTimeout": config.startup_timeout,
        "deviceType": config.device_type.value if config.device_type else "cpu",
        "parallelLevel": config.parallel_level,
        "jobQueueSize": entry.job_queue_size,
        "loadedAtStartup": entry.loaded_at_startup,
        "isDefault": is_default,
        "continuousBatching": True,
        "model": describe_model_dir(entry.archive.model_dir),
        "maxModelLen": info.max_model_len if info else entry.max_model_len,
        "defaultMaxTokens": config.default_max_tokens,
        **lifecycle.describe(entry),
        "workers": workers,
        "jobQueueStatus": {
            "remainingCapacity": max(0, entry.job_queue_size - entry.in_flight),
            "pendingRequests": max(0, entry.in_flight - running),
        },
    }


def _status(message: str, code: int = 200) -> web.Response:
    return web.json_response({"status": message}, status=code)


def _check_model_api(state: ServerState) -> None:
    if not state.config.enable_model_api:
        raise ErrorReply(
            405,
            "Requested method is not allowed: registering and unregistering "
            "models through the API is disabled; start the server with "
            "--enable-model-api (or enable_model_api: true) to allow it",
        )


# -- routes -------------------------------------------------------------------------------
async def list_models(request: web.Request) -> web.Response:
    """The registered models (their default versions), a page at a time."""
    state = request.app[STATE_KEY]
    params = read_params(request.query, ListParams)
    start, limit = params.next_page_token, min(params.limit, MAX_PAGE)
    models = state.registry.sorted_models()
    page = models[start : start + limit]
    body: dict[str, Any] = {"models": [{"modelName": m.name, "modelUrl": m.default.url} for m in page]}
    if start + limit >= len(models):  # LoRA adapters after the models, on the last page
        body["models"] += [
            {"modelName": a.name, "modelUrl": a.url, "parent": a.base.name} for a in state.adapters.sorted()
        ]
    if start + limit < len(models):
        body["nextPageToken"] = str(start + limit)
    return web.json_response(body)


async def register_model(request: web.Request) -> web.Response:
    """Register an archive of the model store (query string or JSON body); needs
    --enable-model-api."""
    state = request.app[STATE_KEY]
    _check_model_api(state)
    params = await _register_params(request)
    url, synchronous = params.url, params.synchronous
    if not url.strip():
        raise SchemaError("url: is required", "url")
    path = resolve_url(url, state.config.model_store_path, state.config.allowed_urls)
    if params.chat_template is not None and not is_model_path(path):
        raise SchemaError(
            "chat_template: only for a .gguf file or a model folder; an archive ships its own chat_template.jinja",
            "chat_template",
        )
    archive = await state.registry.open(path, chat_template=params.chat_template)
    if is_adapter(archive):  # a LoRA adapter: attached to its base version's workers
        adapter = await state.adapters.register(
            state.registry, archive, _display_url(url, path, state.config.model_store_path), params.model_name
        )
        state.registry.save_change(lambda: state.adapters.adapters.pop(adapter.name, None))
        return _status(
            f'Adapter "{adapter.name}" Version: {adapter.version} registered on model '
            f'"{adapter.base.name}" version {adapter.base.version}'
        )
    archive = _with_register_params(archive, params)
    entry = await state.registry.register(
        archive,
        url=_display_url(url, path, state.config.model_store_path),
        name=params.model_name,
        initial_workers=params.initial_workers,
        synchronous=synchronous,
        response_timeout=params.response_timeout,
    )
    n = entry.min_workers
    message = f'Model "{entry.name}" Version: {entry.version} registered with {n} initial workers'
    if n == 0:
        return _status(message + ". Use scale workers API to add workers for the model.")
    if not synchronous:
        return _status(message + ". Processing worker updates...", 202)
    return _status(message)


def _with_register_params(archive: LoadedArchive, params: RegisterParams) -> LoadedArchive:
    """`startup_timeout` overrides the archive's; `handler` may only name the archive's own."""
    if params.handler is not None:
        own = archive.manifest["model"]["handler"]
        allowed = {own} | (set(BUILTIN_HANDLERS) if archive.custom_handler is None else set())
        if params.handler not in allowed:
            raise SchemaError(
                f"handler: the archive's handler ({own!r}) serves it; another cannot "
                f"be named at registration, got {params.handler!r}",
                "handler",
            )
    changes: dict[str, Any] = {}
    if params.startup_timeout is not None:
        changes["startup_timeout"] = params.startup_timeout
    if params.worker_roles is not None:
        changes["worker_roles"] = params.worker_roles
    if not changes:
        return archive
    config = msgspec.structs.replace(archive.model_config, **changes)
    return dataclasses.replace(archive, model_config=config)


def _display_url(url: str, path: Path, store: Path) -> str:
    """The URL as snapshots and GET /models show it: relative to the store when inside it."""
    try:
        return str(path.relative_to(store.resolve()))
    except ValueError:
        return url


async def describe_model(request: web.Request) -> web.Response:
    """Describe a model's default version, one version, or `all` of them (workers, queue)."""
    state = request.app[STATE_KEY]
    name = request.match_info["model"]
    version = request.match_info.get("version")
    registry = state.registry
    adapter = state.adapters.get(name)
    if adapter is not None and name not in registry.models and version in (None, "all", adapter.version):
        return web.json_response([adapter.describe()])
    if version == "all":
        registry.resolve(name)  # 404 for an unknown model
        model = registry.models[name]
        entries = [model.versions[v] for v in sorted(model.versions)]
    else:
        entries = [registry.resolve(name, version)]
    default = registry.models[name].default_version
    return web.json_response([describe(e, e.version == default, registry.lifecycle) for e in entries])


async def scale_model(request: web.Request) -> web.Response:
    """Scale a version's workers (`min_worker`, `max_worker`, `synchronous`, `timeout`)."""
    state = request.app[STATE_KEY]
    params = read_params(request.query, ScaleParams)
    entry = state.registry.resolve(request.match_info["model"], request.match_info.get("version"))
    # An omitted bound keeps the version's own; the registry checks min <= max for every caller.
    min_w = entry.min_workers if params.min_worker is None else params.min_worker
    synchronous = params.synchronous
    done = await state.registry.scale(entry, min_w, params.max_worker, synchronous=synchronous, timeout=params.timeout)
    if not synchronous:
        return _status("Processing worker updates...", 202)
    if not done:
        return _status(
            f"Workers are still being scaled to {min_w} after {params.timeout}s; processing worker updates...", 202
        )
    return _status(f"Workers scaled to {min_w} for model: {entry.name}, version: {entry.version}")


async def set_default(request: web.Request) -> web.Response:
    """Make a version the one unversioned requests go to."""
    state = request.app[STATE_KEY]
    entry = state.registry.set_default(request.match_info["model"], request.match_info["version"])
    return _status(f'Default version successfully updated for model "{entry.name}" to "{entry.version}"')


async def unregister_model(request: web.Request) -> web.Response:
    """Unregister a version (or the model's default version); needs --enable-model-api."""
    state = request.app[STATE_KEY]
    _check_model_api(state)
    read_params(request.query, UnregisterParams)
    name = request.match_info["model"]
    if name in state.adapters.adapters and name not in state.registry.models:
        adapter = await state.adapters.unregister(name)  # returns once its requests in flight are done
        state.registry.save_change(None)
        return _status(f'Adapter "{adapter.name}" version: {adapter.version} unregistered')
    attached = state.adapters.attached_to(state.registry.resolve(name, request.match_info.get("version")))
    if attached:
        raise ForbiddenError(
            f"Can't remove model {name}: LoRA adapters run on it "
            f"({', '.join(a.name for a in attached)}); unregister them first"
        )
    entry = await state.registry.unregister(request.match_info["model"], request.match_info.get("version"))
    return _status(f'Model "{entry.name}" version: {entry.version} unregistered')


async def rotate_token(request: web.Request) -> web.Response:
    """Replace the inference or management key (`type`) with a new one, written to the key
    file first; the old key stops working at once. 400 when token authorization is off."""
    state = request.app[STATE_KEY]
    api = Api(read_params(request.query, TokenParams).type)
    if state.keys is None:
        raise ErrorReply(400, "token authorization is off (--disable-token-auth): there is no key to rotate")
    try:
        key = state.keys.rotate(api)
    except OSError as exc:
        raise ErrorReply(
            500, f"the key file {state.keys.path} cannot be written ({exc.strerror}); the key was not changed"
        ) from None
    return web.json_response({api.value: {"key": key}})


# -- app ----------------------------------------------------------------------------------
EXCEPTION_CODES = (
    ((ModelNotFoundError, ArchiveNotFoundError), 404),
    ((ConflictError, LifecycleConflict), 409),
    (ModelTooLargeError, 507),
    ((ForbiddenError, UrlNotAllowedError), 403),
    (WorkerStartFailed, 500, "Failed to start workers: {}"),
    (NoWorkerError, 503),
    (SaveFailedError, attrgetter("status")),  # 507 disk full, else 500; the change rolled back
    ((SchemaError, ArchiveError, ModelConfigError, ValueError, FileExistsError), 400),
)
ROUTES = [
    web.get("/models", list_models),
    web.post("/models", register_model),
    web.get("/models/{model}", describe_model),
    web.get("/models/{model}/{version}", describe_model),
    web.put("/models/{model}", scale_model),
    web.put("/models/{model}/{version}", scale_model),
    web.put("/models/{model}/{version}/set-default", set_default),
    web.delete("/models/{model}", unregister_model),
    web.delete("/models/{model}/{version}", unregister_model),
    web.get("/token", rotate_token),
    *LIFECYCLE_ROUTES,
]
QUERY_PARAMS = {
    list_models: ListParams,
    register_model: RegisterParams,
    scale_model: ScaleParams,
    unregister_model: UnregisterParams,
    rotate_token: TokenParams,
}


def _shape(request: web.Request, code: int, message: str, param: str | None) -> dict[str, Any]:
    """TorchServe's error body; an unknown path is its ResourceNotFoundException."""
    unrouted = code == 404 and request.match_info.route.name is None and not request.match_info
    return error_body(code, message, "ResourceNotFoundException" if unrouted else None)


def _observe(request: web.Request, status: int, seconds: float) -> None:
    """Count every management request by status. The model label is the model named in the
    path only when it is registered: unknown names must not grow the label set."""
    state = request.app[STATE_KEY]
    name = request.match_info.get("model")
    state.metrics.observe_request(name if name in state.registry.models else None, "management", status, seconds)


def build_management_app(state: ServerState, contexts: Iterable[Callable] = ()) -> web.Application:
    """The management app over `state`; `contexts` are extra `cleanup_ctx` generators."""
    app = web.Application(client_max_size=state.config.max_request_size)
    app[STATE_KEY] = state
    public = console.setup(app)  # the console's page and files: no data, no token needed
    app.middlewares.extend(
        [
            error_middleware(_shape, EXCEPTION_CODES, _observe),
            drain_middleware(state.drain),
            auth_middleware(lambda: state.management_key, public),
            decode_body_middleware,
        ]
    )
    app.add_routes(ROUTES)
    app.add_routes(
        openapi.routes(
            "pagedserve management API",
            {
                handler: openapi.Body(("application/json",) if handler is register_model else (), query=query)
                for handler, query in QUERY_PARAMS.items()
            },
        )
    )
    app.cleanup_ctx.extend(contexts)
    return app
