"""The inference port: health, TorchServe /predictions, the OpenAI-compatible API, KServe's
v1 and v2 protocols (pagedserve.server.kserve.routes) and the OpenAPI description (pagedserve.server.common.openapi).

Routes (the OpenAI ones also under /predictions/{model}/{version}/v1/...):
  GET  /ping  /live  /ready                    no token needed unless health_needs_token
  POST|PUT /predictions/{model}[/{version}]    JSON, text, a form or a raw upload in
                                               (pagedserve.server.torchserve.bodies), JSON out; "stream": true
                                               -> NDJSON chunks (a model with a custom handler:
                                               its preprocess reads the body, its postprocess
                                               writes the reply)
  POST /v1/completions  /v1/chat/completions   OpenAI bodies; "stream": true -> SSE (a list of
                                               prompts: one request per prompt, pagedserve.server.serving.fanout)
  POST /v1/responses                           OpenAI's Responses API, stateless
                                               (pagedserve.handlers.openai_responses_api)
  POST /v1/embeddings                          the prompts' embeddings (pagedserve.engine.request.pooling: a pooling
                                               request per input; pagedserve.handlers.openai_embeddings)
  GET  /v1/models  /v1/models/{id}
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
version, `admit` it (jobQueueSize), parse, tokenize off the loop, pick a worker, generate
(pagedserve.server.serving.generation).
"""

from __future__ import annotations

import asyncio
import logging
import re
import time
from collections.abc import Callable, Iterable
from typing import Any

from aiohttp import web

from pagedserve.engine.request.inputs import pooling_sampling_params
from pagedserve.engine.request.pooling import PoolingParams
from pagedserve.handlers.base_handler import BaseHandler, HandlerError
from pagedserve.handlers.llm_input import ParsedBody, parse_predictions_body
from pagedserve.handlers.openai_embeddings import parse_embeddings_request
from pagedserve.handlers.openai_protocol import OpenAIRequest, parse_chat_request, parse_completion_request, split_model
from pagedserve.handlers.openai_responses import OpenAIFormatter
from pagedserve.handlers.openai_responses_api import ResponsesRequest, ResponsesShaper, parse_responses_request
from pagedserve.handlers.openai_tools import ToolParser, tool_prompt
from pagedserve.handlers.tool_tags import with_tool_constraint
from pagedserve.server.anthropic import routes as anthropic
from pagedserve.server.anthropic.shaping import error_body as anthropic_error
from pagedserve.server.common import openapi
from pagedserve.server.common.auth import auth_middleware
from pagedserve.server.common.errors import error_body
from pagedserve.server.console.app import allow_console
from pagedserve.server.kserve import routes as kserve
from pagedserve.server.ollama import routes as ollama
from pagedserve.server.serving.body_encoding import decode_body_middleware
from pagedserve.server.serving.fanout import FanOut
from pagedserve.server.serving.generation import (
    MODEL_KEY,
    REQUEST_ID_KEY,
    ErrorReply,
    Prepared,
    Shaper,
    prepare,
    respond,
)
from pagedserve.server.serving.middleware import drain_middleware, error_middleware
from pagedserve.server.serving.request_scope import (
    ADAPTER_KEY,
    adapter_in_flight,
    admitted,
    handler_call,
    keep_alive,
    lora,
    raw_keep_alive,
    read_json,
    resolve,
)
from pagedserve.server.serving.shapers import (
    EmbeddingsShaper,
    HandlerShaper,
    OpenAIShaper,
    PredictionShaper,
    openai_error,
)
from pagedserve.server.serving.state import STATE_KEY, ServerState
from pagedserve.server.serving.streaming import StreamFormat
from pagedserve.server.torchserve.bodies import read_predictions_body
from pagedserve.server.vllm import routes as vllm
from pagedserve.server.workers.adapters import RegisteredAdapter
from pagedserve.server.workers.registry import ModelVersion, NoWorkerError, QueueFullError

OPENAI_ENDPOINTS = frozenset(
    {
        "completions",
        "chat_completions",
        "responses",
        "embeddings",
        "models",
        "model",
        "tokenize",
        "detokenize",
        "vllm_version",
        "health",
    }
)
OPENAI_PATH = re.compile(r"(/predictions/[^/]+/[^/]+)?/v1(/.*)?")  # /v1/... of a version too
KSERVE_PATH = re.compile(r"/v2(/.*)?")
# Health probes: never drained away, and public unless health_needs_token.
HEALTH_PATHS = frozenset({"/ping", "/live", "/ready", "/health", "/v2/health/live", "/v2/health/ready"})
EXCEPTION_CODES = (((QueueFullError, NoWorkerError), 503),)
PREDICTIONS_CONTENT_TYPES = (
    "application/json",
    "text/plain",
    "multipart/form-data",
    "application/x-www-form-urlencoded",
    "application/octet-stream",
)
routes = web.RouteTableDef()
logger = logging.getLogger(__name__)


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


# -- /predictions ----------------------------------------------------------------------------


@routes.post("/predictions/{model}", name="predictions")
@routes.put("/predictions/{model}", name="predictions_put")
@routes.post("/predictions/{model}/{version}", name="predictions_version")
@routes.put("/predictions/{model}/{version}", name="predictions_version_put")
async def predictions(request: web.Request) -> web.StreamResponse:
    """TorchServe's inference call: a prompt (JSON with `prompt` or `messages` and sampling
    fields, plain text, a form, or a raw upload) -> choices, usage, timings; streamed as NDJSON
    with `"stream": true`."""
    started = time.monotonic()
    state = request.app[STATE_KEY]
    version = resolve(request, state, request.match_info["model"], request.match_info.get("version"))
    handler = version.handler
    seconds = None  # keep_alive
    if handler is None:
        body = await read_predictions_body(request, state.executor, state.config.max_request_size)
        seconds = keep_alive(body)
        shaper = PredictionShaper(version.name, request[REQUEST_ID_KEY])
    else:  # a custom handler reads any body: JSON or not is its call
        raw, seconds = raw_keep_alive(await request.read())
        shaper = HandlerShaper(version.name, request[REQUEST_ID_KEY], handler=handler)
    with version.admit(seconds), adapter_in_flight(request):
        if handler is None:
            parsed = handler_call(parse_predictions_body, body)
        else:
            parsed = await _custom_preprocess(request, state, handler, raw)
        job = await prepare(
            state, version, parsed.prompt, parsed.params, client=request.remote or "", lora=lora(request)
        )
        return await respond(request, state, version, job, shaper, stream=parsed.stream, started=started)


async def _custom_preprocess(request: web.Request, state: ServerState, handler: BaseHandler, raw: bytes) -> ParsedBody:
    """The custom handler's preprocess of one TorchServe-style request, in the thread pool."""
    headers = {k: v for k, v in request.headers.items() if k.lower() != "authorization"}
    loop = asyncio.get_running_loop()
    try:
        results = await loop.run_in_executor(state.executor, handler.preprocess, [{"body": raw, "headers": headers}])
    except HandlerError as exc:
        raise ErrorReply.from_handler_error(exc) from None
    except Exception as exc:  # their code: answer 500 and say where
        logger.exception("the custom handler's preprocess failed")
        raise ErrorReply(500, f"the custom handler's preprocess failed: {type(exc).__name__}: {exc}") from None
    parsed = results[0] if isinstance(results, list) and len(results) == 1 else results
    if isinstance(parsed, HandlerError):
        raise ErrorReply.from_handler_error(parsed)
    if not isinstance(parsed, ParsedBody):
        raise ErrorReply(
            500,
            "the custom handler's preprocess must return a list with one "
            f"ParsedBody or HandlerError per request, got {type(parsed).__name__}",
        )
    return parsed


# -- OpenAI ----------------------------------------------------------------------------------


@routes.post("/v1/completions", name="completions")
@routes.post("/predictions/{model}/{version}/v1/completions", name="completions_version")
async def completions(request: web.Request) -> web.StreamResponse:
    """OpenAI completions (SSE with `"stream": true`)."""
    return await _openai(request, parse_completion_request)


@routes.post("/v1/chat/completions", name="chat_completions")
@routes.post("/predictions/{model}/{version}/v1/chat/completions", name="chat_completions_version")
async def chat_completions(request: web.Request) -> web.StreamResponse:
    """OpenAI chat completions, with tool calling (SSE with `"stream": true`)."""
    return await _openai(request, parse_chat_request)


@routes.post("/v1/responses", name="responses")
@routes.post("/predictions/{model}/{version}/v1/responses", name="responses_version")
async def responses(request: web.Request) -> web.StreamResponse:
    """OpenAI's Responses API, stateless."""
    return await _openai(request, parse_responses_request)


async def _openai(
    request: web.Request, parse: Callable[[dict[str, Any]], OpenAIRequest | ResponsesRequest]
) -> web.StreamResponse:
    started, state, body, version, asked = await _openai_begin(request)
    with _admitted(request, version, body):
        parsed = handler_call(parse, body)
        responses_request = parsed if isinstance(parsed, ResponsesRequest) else None
        parsed = parsed.chat if responses_request is not None else parsed
        template = getattr(version.tokenizer, "chat_template", None)
        specs = [
            tool_prompt(spec, parsed.tools, template) if spec.messages is not None else spec for spec in parsed.prompts
        ]
        params = with_tool_constraint(parsed.params, parsed.tools, ToolParser(version.model_config.tool_parser))
        jobs = [
            await prepare(
                state,
                version,
                spec,
                params,
                client=request.remote or "",
                lora=lora(request),
                priority=parsed.priority,
                cache_salt=parsed.cache_salt,
            )
            for spec in specs
        ]
        job = jobs[0] if len(jobs) == 1 else FanOut(jobs, parsed.params.n).prepared()
        shaper = _openai_shaper(request, version, asked, responses_request or parsed, jobs)
        return await respond(request, state, version, job, shaper, stream=parsed.stream, started=started)


@routes.post("/v1/embeddings", name="embeddings")
@routes.post("/predictions/{model}/{version}/v1/embeddings", name="embeddings_version")
async def embeddings(request: web.Request) -> web.StreamResponse:
    """One pooling request per input (a list: pagedserve.server.serving.fanout), answered whole."""
    started, state, body, version, asked = await _openai_begin(request)
    with _admitted(request, version, body):
        parsed = handler_call(parse_embeddings_request, body)
        params = pooling_sampling_params()
        try:
            jobs = [
                await prepare(
                    state,
                    version,
                    spec,
                    params,
                    client=request.remote or "",
                    pooling=PoolingParams(),
                    lora=lora(request),
                )
                for spec in parsed.prompts
            ]
        except ErrorReply as exc:  # the engine names the prompt; this body calls it `input`
            exc.param = "input" if exc.param == "prompt" else exc.param
            raise
        job = jobs[0] if len(jobs) == 1 else FanOut(jobs, 1).prepared()
        return await respond(
            request, state, version, job, EmbeddingsShaper(parsed, asked), stream=False, started=started
        )


async def _openai_begin(request: web.Request) -> tuple[float, ServerState, dict[str, Any], ModelVersion, str]:
    """An OpenAI route's start: its arrival time, the state, the JSON body, the version it asks
    for and the name to answer with."""
    started = time.monotonic()
    state = request.app[STATE_KEY]
    body = await read_json(request)
    return (started, state, body, *_openai_model(request, state, body))


def _admitted(request: web.Request, version: ModelVersion, body: dict[str, Any]):
    """An OpenAI request counted in flight on its version (with its `keep_alive`) and on its
    LoRA adapter, for the whole `with` block."""
    return admitted(request, version, keep_alive(body))


def _openai_model(request: web.Request, state: ServerState, body: dict[str, Any]) -> tuple[ModelVersion, str]:
    """The version an OpenAI body asks for (by its `model`, or by the route's prefix) and the
    name to answer with."""
    if "model" in request.match_info:  # the path names the model and version
        version = resolve(request, state, request.match_info["model"], request.match_info["version"])
        return version, body.get("model") if isinstance(body.get("model"), str) else version.name
    asked = body.get("model")
    if not isinstance(asked, str) or not asked:
        raise ErrorReply(
            400, "'model' is required: the name of a registered model (model or model@version)", param="model"
        )
    return resolve(request, state, *handler_call(split_model, asked)), asked


def _openai_shaper(
    request: web.Request,
    version: ModelVersion,
    asked: str,
    parsed: OpenAIRequest | ResponsesRequest,
    jobs: list[Prepared],
) -> Shaper:
    """The reply's shape: a Responses API response, or a (chat) completion with the prompts'
    texts when it echoes them."""
    parser = ToolParser(version.model_config.tool_parser)
    if isinstance(parsed, ResponsesRequest):
        return ResponsesShaper(
            parsed, "resp_" + request[REQUEST_ID_KEY], asked, int(time.time()), parser, StreamFormat.SSE
        )
    prefix = "chatcmpl-" if request.match_info.route.name.startswith("chat") else "cmpl-"
    echoed = (
        [j.input.prompt if j.input.prompt is not None else version.tokenizer.decode(j.input.token_ids) for j in jobs]
        if parsed.echo
        else []
    )
    return OpenAIShaper(
        OpenAIFormatter(parsed, prefix + request[REQUEST_ID_KEY], asked, int(time.time()), echoed, parser)
    )


@routes.get("/v1/models", name="models")
@routes.get("/predictions/{model}/{version}/v1/models", name="models_version")
async def models(request: web.Request) -> web.Response:
    """OpenAI's model list: every model (its default version) and every `name@version`."""
    state = request.app[STATE_KEY]
    if "model" in request.match_info:
        versions = [resolve(request, state, request.match_info["model"], request.match_info["version"])]
        entries = [(f"{v.name}@{v.version}", v) for v in versions]
    else:
        entries = []
        for model in state.registry.sorted_models():
            if model.default_version in model.versions:
                entries.append((model.name, model.versions[model.default_version]))
            entries += [(f"{model.name}@{v}", entry) for v, entry in sorted(model.versions.items())]
    data = [_model_entry(name, v) for name, v in entries]
    if "model" not in request.match_info:
        data += [_adapter_entry(a) for a in state.adapters.sorted()]
    return web.json_response({"object": "list", "data": data})


@routes.get(r"/v1/models/{id:[^{}/:]+}", name="model")
async def model(request: web.Request) -> web.Response:
    """One model by the id /v1/models lists (`name` or `name@version`); 404 if none. Its
    `name` and `ready` fields answer KServe v1's model status call on the same path."""
    name = request.match_info["id"]
    version = resolve(request, request.app[STATE_KEY], *handler_call(split_model, name))
    adapter = request.get(ADAPTER_KEY)
    entry = _model_entry(name, version) if adapter is None else _adapter_entry(adapter)
    return web.json_response({**entry, "name": name, "ready": bool(version.pool.ready_engines())})


def _model_entry(name: str, version: ModelVersion) -> dict[str, Any]:
    return {
        "id": name,
        "object": "model",
        "created": int(version.registered_at.timestamp()),
        "owned_by": "pagedserve",
        "root": version.name,
        "version": version.version,
        "max_model_len": _max_model_len(version),
    }


def _adapter_entry(adapter: RegisteredAdapter) -> dict[str, Any]:
    """A LoRA adapter as /v1/models lists it: its base model version is its `parent`."""
    return {
        **_model_entry(adapter.name, adapter.base),
        "root": adapter.name,
        "version": adapter.version,
        "created": int(adapter.registered_at.timestamp()),
        "parent": adapter.base.name,
        "parent_version": adapter.base.version,
    }


def _max_model_len(version: ModelVersion) -> int | None:
    infos = [w.info for w in version.workers() if w.info is not None]
    return infos[0].max_model_len if infos else version.max_model_len


# -- helpers ---------------------------------------------------------------------------------


def _bodies() -> dict[Callable, openapi.Body]:
    """What each POST route takes, for the OpenAPI description."""
    json_only = openapi.Body(("application/json",))
    return {
        predictions: openapi.Body(PREDICTIONS_CONTENT_TYPES),
        completions: json_only,
        chat_completions: json_only,
        responses: json_only,
        kserve.v1_predict: json_only,
        kserve.v2_infer: json_only,
    }
