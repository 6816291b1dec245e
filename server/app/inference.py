"""The inference port: health, TorchServe /predictions, the OpenAI-compatible API, KServe's
v1 and v2 protocols (pagedserve.server.kserve.routes) and the OpenAPI description (pagedserve.server.common.openapi).

Routes, each API surface's in its own folder:
  GET  /ping  /live  /ready                    no token needed unless health_needs_token (here)
  POST|PUT /predictions/{model}[/{version}]    TorchServe's (pagedserve.server.torchserve.routes)
  /v1/completions /v1/chat/completions         OpenAI's, also under /predictions/{model}/{version}/v1/...
  /v1/responses /v1/embeddings /v1/models      (pagedserve.server.openai.routes)
  POST /v1/models/{model}:predict  /v2/...     KServe (pagedserve.server.kserve.routes)
  /api/generate /api/chat /api/embed ...       Ollama's API (pagedserve.server.ollama)
  POST /v1/messages[/count_tokens]             Anthropic's Messages API (pagedserve.server.anthropic)
  /tokenize /detokenize /version /health       vLLM's extra routes (pagedserve.server.vllm)
  OPTIONS /  GET /api-description              this port's OpenAPI description

Middlewares (pagedserve.server.serving.middleware), outermost first: request id, metrics and error replies; 503
while draining; token authorization. Every error is raised and shaped in one place by route:
OpenAI's `{"error": {"message", "type", "param", "code"}}` on the OpenAI routes (and any other
path under /v1/), KServe's `{"error": "..."}` on its routes (and any path under /v2), Ollama's
`{"error": "..."}` under /api/, Anthropic's `{"type": "error", "error": {...}}` on /v1/messages,
TorchServe's `{"code", "type", "message"}` elsewhere. Per request: resolve the
version, `admit` it (jobQueueSize), parse the body once into a `GenerationRequest` (in the
surface's folder), then the shared path: tokenize off the loop, pick a worker, generate
(pagedserve.server.serving.generation_request).
"""

from __future__ import annotations

import re
from collections.abc import Callable, Iterable
from typing import Any

from aiohttp import web

from pagedserve.server.anthropic import routes as anthropic
from pagedserve.server.anthropic.shaping import error_body as anthropic_error
from pagedserve.server.common import openapi
from pagedserve.server.common.auth import auth_middleware
from pagedserve.server.common.errors import error_body
from pagedserve.server.console.app import allow_console
from pagedserve.server.kserve import routes as kserve
from pagedserve.server.ollama import routes as ollama
from pagedserve.server.openai import routes as openai
from pagedserve.server.serving.body_encoding import decode_body_middleware
from pagedserve.server.serving.generation import MODEL_KEY
from pagedserve.server.serving.middleware import drain_middleware, error_middleware
from pagedserve.server.serving.shapers import openai_error
from pagedserve.server.serving.state import STATE_KEY, ServerState
from pagedserve.server.torchserve import routes as torchserve
from pagedserve.server.vllm import routes as vllm
from pagedserve.server.workers.pool import NoWorkerError
from pagedserve.server.workers.rules import QueueFullError

# Routes whose errors are OpenAI-shaped: OpenAI's and vLLM's extra routes.
OPENAI_ENDPOINTS = openai.ENDPOINTS | {"tokenize", "detokenize", "vllm_version", "health"}
OPENAI_PATH = re.compile(r"(/predictions/[^/]+/[^/]+)?/v1(/.*)?")  # /v1/... of a version too
KSERVE_PATH = re.compile(r"/v2(/.*)?")
# Health probes: never drained away, and public unless health_needs_token.
HEALTH_PATHS = frozenset({"/ping", "/live", "/ready", "/health", "/v2/health/live", "/v2/health/ready"})
EXCEPTION_CODES = (((QueueFullError, NoWorkerError), 503),)
routes = web.RouteTableDef()


def build_inference_app(state: ServerState, contexts: Iterable[Callable] = ()) -> web.Application:
    """The inference app over `state`; `contexts` are `cleanup_ctx` generators (the server's
    lifecycle: registry, workers, thread pool) run when the app starts and stops."""
    public = frozenset() if state.config.health_needs_token else HEALTH_PATHS
    app = web.Application(
        client_max_size=state.config.max_request_size,
        middlewares=[
            error_middleware(_shape, EXCEPTION_CODES, _observe),
            drain_middleware(state.drain, exempt=HEALTH_PATHS),
            auth_middleware(lambda: state.inference_key, public),
            decode_body_middleware,
        ],
    )
    app[STATE_KEY] = state
    allow_console(app, state)  # the console's playground (another origin) may call in
    app.add_routes(routes)
    app.add_routes(torchserve.routes)
    app.add_routes(openai.routes)
    app.add_routes(kserve.routes)
    app.add_routes(ollama.routes)
    app.add_routes(anthropic.routes)
    app.add_routes(vllm.routes)
    app.add_routes(openapi.routes("pagedserve inference API", _bodies()))
    app.cleanup_ctx.extend(contexts)
    return app


# -- errors and metrics -----------------------------------------------------------------------


def _endpoint(request: web.Request) -> str | None:
    name = request.match_info.route.name
    return name.removesuffix("_put").removesuffix("_version") if name else None


def _is_openai_route(request: web.Request) -> bool:
    endpoint = _endpoint(request)
    if endpoint is not None:
        return endpoint in OPENAI_ENDPOINTS
    return OPENAI_PATH.fullmatch(request.path) is not None  # no route matched: judged by the path


def _api_of(request: web.Request) -> str | None:
    """The API a route of its own subpackage speaks (its routes' name prefix, or for a path no
    route matched, the path's): "ollama", "anthropic" or None."""
    endpoint = _endpoint(request)
    if endpoint is not None:
        api = endpoint.partition("_")[0]
        return api if api in ("ollama", "anthropic") else None
    if request.path.startswith("/api/"):
        return "ollama"
    return "anthropic" if request.path.startswith("/v1/messages") else None


def _is_kserve_route(request: web.Request) -> bool:
    endpoint = _endpoint(request)
    if endpoint is not None:
        return endpoint.startswith("kserve_")
    return KSERVE_PATH.fullmatch(request.path) is not None


def _openai_shape(code: int, message: str, param: str | None = None) -> dict[str, Any]:
    body = openai_error(code, message, param)
    if code < 500:
        body["error"]["type"] = body["error"]["type"].replace("server_error", "invalid_request_error")
    return body


def _kserve_shape(code: int, message: str, param: str | None = None) -> dict[str, Any]:
    return kserve.error_body(message)


# The error shape of each API surface by path, most specific first; any other path gets
# TorchServe's. Used for requests no route matched and for aiohttp's own (parser) errors; an
# API surface in its own package adds its (pattern, shape) here.
PATH_SHAPES: tuple[tuple[re.Pattern, Callable[..., dict[str, Any]]], ...] = (
    (KSERVE_PATH, _kserve_shape),
    (re.compile(r"/api/.*"), lambda code, message, param=None: ollama.error_body(message)),
    (re.compile(r"/v1/messages(/.*)?"), lambda code, message, param=None: anthropic_error(code, message)),
    (OPENAI_PATH, _openai_shape),
)


def shape_for_path(path: str, code: int, message: str, param: str | None = None) -> dict[str, Any]:
    for pattern, shape in PATH_SHAPES:
        if pattern.fullmatch(path):
            return shape(code, message, param)
    return error_body(code, message)


def _shape(request: web.Request, code: int, message: str, param: str | None) -> dict[str, Any]:
    if _is_kserve_route(request):
        return _kserve_shape(code, message)
    api = _api_of(request)
    if api == "ollama":
        return ollama.error_body(message)
    if api == "anthropic":
        return anthropic_error(code, message)
    if not _is_openai_route(request):
        return shape_for_path(request.path, code, message, param)
    body = _openai_shape(code, message, param)
    if _endpoint(request) is None:  # no such route: not a missing model
        body["error"]["code"] = "unknown_url" if code == 404 else code
    return body


def _observe(request: web.Request, status: int, seconds: float) -> None:
    request.app[STATE_KEY].metrics.observe_request(
        request.get(MODEL_KEY), _endpoint(request) or "unknown", status, seconds
    )


# -- health ----------------------------------------------------------------------------------


@routes.get("/ping", name="ping")
async def ping(request: web.Request) -> web.Response:
    """TorchServe's health check: Healthy when every version that should serve can serve."""
    healthy = request.app[STATE_KEY].serving()
    return web.json_response({"status": "Healthy" if healthy else "Unhealthy"}, status=200 if healthy else 500)


@routes.get("/live", name="live")
async def live(request: web.Request) -> web.Response:
    """Liveness: 200 until the server starts draining, then 503. It does not depend on the
    models: one model whose workers crash-loop must not get the whole process restarted
    (/ping and /ready say it is not serving)."""
    if request.app[STATE_KEY].draining:
        return web.json_response({"status": "Draining"}, status=503)
    return web.json_response({"status": "Alive"})


@routes.get("/ready", name="ready")
async def ready(request: web.Request) -> web.Response:
    """Readiness: 200 when every version that should serve has a ready worker; 503 while
    starting or draining."""
    state = request.app[STATE_KEY]
    if state.draining:
        return web.json_response({"status": "Draining"}, status=503)
    if not state.serving():
        return web.json_response({"status": "NotReady", "notReady": state.not_serving()}, status=503)
    return web.json_response({"status": "Ready"})


# -- helpers ---------------------------------------------------------------------------------


def _bodies() -> dict[Callable, openapi.Body]:
    """What each POST route takes, for the OpenAPI description."""
    json_only = openapi.Body(("application/json",))
    return {
        torchserve.predictions: openapi.Body(torchserve.PREDICTIONS_CONTENT_TYPES),
        openai.completions: json_only,
        openai.chat_completions: json_only,
        openai.responses: json_only,
        kserve.v1_predict: json_only,
        kserve.v2_infer: json_only,
    }
