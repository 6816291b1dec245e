"""The management port: TorchServe's management API (register, list, describe, scale,
set-default, unregister) with its parameters, status codes and JSON shapes.

Registration and unregistration answer 405 unless the model API is enabled
(`--enable-model-api`). Errors are `{"code", "type", "message"}`.
"""

from __future__ import annotations

import json
import os
import time
from pathlib import Path
from typing import Any

from aiohttp import web

from engine.model.archive_manifest import ArchiveError
from engine.model.model_config import ModelConfigError
from server.archives import ArchiveNotFoundError, UrlNotAllowedError, resolve_url
from server.auth import auth_middleware
from server.errors import error_response
from server.registry import (
    ConflictError,
    ForbiddenError,
    ModelNotFoundError,
    ModelVersion,
    NoWorkerError,
    SaveFailedError,
)
from server.state import STATE_KEY, ServerState
from server.workers import WorkerStartFailed

REGISTER_PARAMS = frozenset({"url", "model_name", "initial_workers", "synchronous",
                             "response_timeout", "batch_size", "max_batch_delay", "runtime"})
SCALE_PARAMS = frozenset({"min_worker", "max_worker", "synchronous", "timeout",
                          "number_gpu"})
MAX_PAGE = 1000


class BadParam(ValueError):
    """A malformed parameter (400); the message names it."""


# -- parameters ---------------------------------------------------------------------------
def _int_param(params: dict[str, Any], name: str, default: int | None, minimum: int = 0) -> int | None:
    value = params.get(name)
    if value is None or value == "":
        return default
    try:
        number = int(value) if not isinstance(value, bool) else None
    except (TypeError, ValueError):
        number = None
    if number is None or number < minimum:
        raise BadParam(f"Parameter {name} must be an integer >= {minimum}, got {value!r}")
    return number


def _bool_param(params: dict[str, Any], name: str, default: bool) -> bool:
    value = params.get(name)
    if value is None or value == "":
        return default
    if isinstance(value, bool):
        return value
    text = str(value).lower()
    if text in ("true", "1", "yes"):
        return True
    if text in ("false", "0", "no"):
        return False
    raise BadParam(f"Parameter {name} must be true or false, got {value!r}")


def _check_known(params: dict[str, Any], allowed: frozenset[str]) -> None:
    unknown = sorted(set(params) - allowed)
    if unknown:
        raise BadParam(f"Unknown parameter(s) {unknown}; allowed: {sorted(allowed)}")


async def _register_params(request: web.Request) -> dict[str, Any]:
    params: dict[str, Any] = dict(request.query)
    body = await request.read()
    if body.strip():
        try:
            data = json.loads(body)
        except (UnicodeDecodeError, json.JSONDecodeError) as exc:
            raise BadParam(f"the request body is not valid JSON: {exc}") from None
        if not isinstance(data, dict):
            raise BadParam("the request body must be a JSON object")
        params.update(data)
    return params


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


def describe(entry: ModelVersion, is_default: bool) -> dict[str, Any]:
    config = entry.model_config
    workers = []
    for slot in entry.pool.slots:
        engine = slot.engine
        pid = engine.pid if engine is not None else None
        workers.append({
            "id": slot.id,
            "startTime": slot.start_time.isoformat(timespec="milliseconds").replace("+00:00", "Z"),
            "status": slot.status.value,
            "memoryUsage": _memory_usage(pid),
            "pid": pid if pid is not None else -1,
            "gpu": bool(engine is not None and str(engine.config.device).startswith("cuda")),
            "gpuUsage": "N/A",
            "restarts": slot.restarts,
            "threads": (engine.stats.num_threads or engine.num_threads) if engine is not None else None,
            "lastError": slot.last_error,
            "requestsInFlight": engine.num_unfinished if engine is not None and engine.is_ready else 0,
        })
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
        "maxModelLen": info.max_model_len if info else entry.max_model_len,
        "workers": workers,
        "jobQueueStatus": {
            "remainingCapacity": max(0, entry.job_queue_size - entry.in_flight),
            "pendingRequests": max(0, entry.in_flight - running),
        },
    }


def _status(message: str, code: int = 200) -> web.Response:
    return web.json_response({"status": message}, status=code)


def _model_api_disabled() -> web.Response:
    return error_response(405, "Requested method is not allowed: registering and unregistering "
                               "models through the API is disabled; start the server with "
                               "--enable-model-api (or enable_model_api: true) to allow it")


# -- routes -------------------------------------------------------------------------------
async def list_models(request: web.Request) -> web.Response:
    state = request.app[STATE_KEY]
    limit = _int_param(request.query, "limit", 100, minimum=1)
    start = _int_param(request.query, "next_page_token", 0, minimum=0)
    limit = min(limit, MAX_PAGE)
    models = state.registry.sorted_models()
    page = models[start:start + limit]
    body: dict[str, Any] = {"models": [
        {"modelName": m.name, "modelUrl": m.versions[m.default_version].url} for m in page]}
    if start + limit < len(models):
        body["nextPageToken"] = str(start + limit)
    return web.json_response(body)


async def register_model(request: web.Request) -> web.Response:
    state = request.app[STATE_KEY]
    if not state.config.enable_model_api:
        return _model_api_disabled()
    params = await _register_params(request)
    _check_known(params, REGISTER_PARAMS)
    url = params.get("url")
    if not isinstance(url, str) or not url.strip():
        raise BadParam("Parameter url is required")
    name = params.get("model_name")
    if name is not None and (not isinstance(name, str) or not name):
        raise BadParam(f"Parameter model_name must be a non-empty string, got {name!r}")
    initial = _int_param(params, "initial_workers", None)
    synchronous = _bool_param(params, "synchronous", False)
    timeout = _int_param(params, "response_timeout", None, minimum=1)
    if _int_param(params, "batch_size", 1, minimum=1) != 1:
        raise BadParam("Parameter batch_size: pagedserve batches continuously inside the "
                       "engine; only batch_size=1 is accepted")
    path = resolve_url(url, state.config.model_store_path, state.config.allowed_urls)
    archive = await state.registry.open(path)
    entry = await state.registry.register(
        archive, url=_display_url(url, path, state.config.model_store_path), name=name,
        initial_workers=initial, synchronous=synchronous, response_timeout=timeout)
    n = entry.min_workers
    message = f'Model "{entry.name}" Version: {entry.version} registered with {n} initial workers'
    if n == 0:
        return _status(message + ". Use scale workers API to add workers for the model.")
    if not synchronous:
        return _status(message + ". Processing worker updates...", 202)
    return _status(message)


def _display_url(url: str, path: Path, store: Path) -> str:
    """The URL as snapshots and GET /models show it: relative to the store when inside it."""
    try:
        return str(path.relative_to(store.resolve()))
    except ValueError:
        return url


async def describe_model(request: web.Request) -> web.Response:
    state = request.app[STATE_KEY]
    name = request.match_info["model"]
    version = request.match_info.get("version")
    registry = state.registry
    if version == "all":
        registry.resolve(name)  # 404 for an unknown model
        model = registry.models[name]
        entries = [model.versions[v] for v in sorted(model.versions)]
    else:
        entries = [registry.resolve(name, version)]
    default = registry.models[name].default_version
    return web.json_response([describe(e, e.version == default) for e in entries])


async def scale_model(request: web.Request) -> web.Response:
    state = request.app[STATE_KEY]
    params = dict(request.query)
    _check_known(params, SCALE_PARAMS)
    entry = state.registry.resolve(request.match_info["model"], request.match_info.get("version"))
    min_w = _int_param(params, "min_worker", entry.min_workers)
    max_w = _int_param(params, "max_worker", None)  # None: the version's maxWorkers
    synchronous = _bool_param(params, "synchronous", False)
    timeout = _int_param(params, "timeout", None, minimum=-1)
    done = await state.registry.scale(entry, min_w, max_w, synchronous=synchronous,
                                      timeout=timeout)
    if not synchronous:
        return _status("Processing worker updates...", 202)
    if not done:
        return _status(f"Workers are still being scaled to {min_w} after {timeout}s; "
                       "processing worker updates...", 202)
    return _status(f"Workers scaled to {min_w} for model: {entry.name}, version: {entry.version}")


async def set_default(request: web.Request) -> web.Response:
    state = request.app[STATE_KEY]
    entry = state.registry.set_default(request.match_info["model"], request.match_info["version"])
    return _status(f'Default version successfully updated for model "{entry.name}" to '
                   f'"{entry.version}"')


async def unregister_model(request: web.Request) -> web.Response:
    state = request.app[STATE_KEY]
    if not state.config.enable_model_api:
        return _model_api_disabled()
    _check_known(dict(request.query), frozenset({"synchronous", "timeout"}))
    entry = await state.registry.unregister(request.match_info["model"],
                                            request.match_info.get("version"))
    return _status(f'Model "{entry.name}" version: {entry.version} unregistered')


# -- app ----------------------------------------------------------------------------------
@web.middleware
async def observe(request: web.Request, handler) -> web.StreamResponse:
    """Count every management request by status. The model label is the model named in the
    path only when it is registered: unknown names must not grow the label set."""
    started = time.monotonic()
    response = await handler(request)
    state = request.app[STATE_KEY]
    name = request.match_info.get("model")
    state.metrics.observe_request(name if name in state.registry.models else None, "management",
                                  response.status, time.monotonic() - started)
    return response


@web.middleware
async def json_errors(request: web.Request, handler) -> web.StreamResponse:
    """Map exceptions to TorchServe's codes and shapes."""
    try:
        return await handler(request)
    except ModelNotFoundError as exc:
        return error_response(404, str(exc))
    except ConflictError as exc:
        return error_response(409, str(exc))
    except (ForbiddenError, UrlNotAllowedError) as exc:
        return error_response(403, str(exc))
    except ArchiveNotFoundError as exc:
        return error_response(404, str(exc))
    except WorkerStartFailed as exc:
        return error_response(500, f"Failed to start workers: {exc}")
    except NoWorkerError as exc:
        return error_response(503, str(exc))
    except SaveFailedError as exc:
        return error_response(exc.status, str(exc))
    except (BadParam, ArchiveError, ModelConfigError, ValueError, FileExistsError) as exc:
        return error_response(400, str(exc))
    except web.HTTPException as exc:
        if exc.status == 404:
            return error_response(404, "Requested resource is not found, please refer to API "
                                       "document.", type="ResourceNotFoundException")
        if exc.status == 405:
            return error_response(405, "Requested method is not allowed, please refer to API "
                                       "document.")
        raise


def build_management_app(state: ServerState) -> web.Application:
    app = web.Application(middlewares=[observe, json_errors,
                                       auth_middleware(state.management_key)],
                          client_max_size=state.config.max_request_size)
    app[STATE_KEY] = state
    r = app.router
    r.add_get("/models", list_models)
    r.add_post("/models", register_model)
    r.add_get("/models/{model}", describe_model)
    r.add_get("/models/{model}/{version}", describe_model)
    r.add_put("/models/{model}", scale_model)
    r.add_put("/models/{model}/{version}", scale_model)
    r.add_put("/models/{model}/{version}/set-default", set_default)
    r.add_delete("/models/{model}", unregister_model)
    r.add_delete("/models/{model}/{version}", unregister_model)
    return app
