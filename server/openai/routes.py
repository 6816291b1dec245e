"""OpenAI's API on the inference port (also under /predictions/{model}/{version}/v1/...):

  POST /v1/completions  /v1/chat/completions   OpenAI bodies; "stream": true -> SSE (a list of
                                               prompts: one request per prompt, pagedserve.server.serving.fanout)
  POST /v1/responses                           OpenAI's Responses API, stateless
                                               (pagedserve.handlers.openai_responses_api)
  POST /v1/embeddings                          the prompts' embeddings (pagedserve.engine.request.pooling: a pooling
                                               request per input; pagedserve.handlers.openai_embeddings)
  GET  /v1/models  /v1/models/{id}

A body is read and checked once, here (pagedserve.handlers.openai_protocol's schemas), into a
`GenerationRequest`, which the shared path runs (pagedserve.server.serving.generation_request).
Errors are OpenAI's `{"error": {...}}` (the inference app shapes them by route).
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

from aiohttp import web

from pagedserve.engine.request.inputs import EngineInput, pooling_sampling_params
from pagedserve.engine.request.pooling import PoolingParams
from pagedserve.handlers.openai_embeddings import parse_embeddings_request
from pagedserve.handlers.openai_protocol import OpenAIRequest, parse_chat_request, parse_completion_request, split_model
from pagedserve.handlers.openai_responses import OpenAIFormatter
from pagedserve.handlers.openai_responses_api import ResponsesRequest, ResponsesShaper, parse_responses_request
from pagedserve.handlers.openai_tools import ToolParser, tool_prompt
from pagedserve.handlers.tool_tags import with_tool_constraint
from pagedserve.server.serving.generation import REQUEST_ID_KEY, ErrorReply, WholeShaper
from pagedserve.server.serving.generation_request import GenerationRequest, run_generation
from pagedserve.server.serving.request_scope import ADAPTER_KEY, admitted, handler_call, keep_alive, lora, read_json
from pagedserve.server.serving.request_scope import resolve as resolve_version
from pagedserve.server.serving.shapers import EmbeddingsShaper, OpenAIShaper
from pagedserve.server.serving.state import STATE_KEY, ServerState
from pagedserve.server.serving.streaming import StreamFormat
from pagedserve.server.workers.adapters import RegisteredAdapter
from pagedserve.server.workers.version import ModelVersion

# The route names of this API: the inference app shapes their errors OpenAI's way.
ENDPOINTS = frozenset({"completions", "chat_completions", "responses", "embeddings", "models", "model"})
routes = web.RouteTableDef()


@routes.post("/v1/completions", name="completions")
@routes.post("/predictions/{model}/{version}/v1/completions", name="completions_version")
async def completions(request: web.Request) -> web.StreamResponse:
    """OpenAI completions (SSE with `"stream": true`)."""
    return await _generate(request, parse_completion_request)


@routes.post("/v1/chat/completions", name="chat_completions")
@routes.post("/predictions/{model}/{version}/v1/chat/completions", name="chat_completions_version")
async def chat_completions(request: web.Request) -> web.StreamResponse:
    """OpenAI chat completions, with tool calling (SSE with `"stream": true`)."""
    return await _generate(request, parse_chat_request)


@routes.post("/v1/responses", name="responses")
@routes.post("/predictions/{model}/{version}/v1/responses", name="responses_version")
async def responses(request: web.Request) -> web.StreamResponse:
    """OpenAI's Responses API, stateless: run as the chat completion it maps onto."""
    return await _generate(request, parse_responses_request)


async def _generate(
    request: web.Request, parse: Callable[[dict[str, Any]], OpenAIRequest | ResponsesRequest]
) -> web.StreamResponse:
    started = time.monotonic()
    state = request.app[STATE_KEY]
    body = await read_json(request)
    version, asked = _model(request, state, body)
    with admitted(request, version, keep_alive(body)):
        parsed = handler_call(parse, body)
        chat = parsed.chat if isinstance(parsed, ResponsesRequest) else parsed
        template = getattr(version.tokenizer, "chat_template", None)
        req = GenerationRequest(
            [tool_prompt(spec, chat.tools, template) if spec.messages is not None else spec for spec in chat.prompts],
            with_tool_constraint(chat.params, chat.tools, ToolParser(version.model_config.tool_parser)),
            chat.stream,
            chat.priority,
            chat.cache_salt,
            kv_produce=chat.kv_produce,
        )

        def shaper(inputs: list[EngineInput]) -> WholeShaper:
            return _shaper(request, version, asked, parsed, inputs)

        return await run_generation(request, state, version, req, shaper, started=started, lora=lora(request))


@routes.post("/v1/embeddings", name="embeddings")
@routes.post("/predictions/{model}/{version}/v1/embeddings", name="embeddings_version")
async def embeddings(request: web.Request) -> web.StreamResponse:
    """One pooling request per input (a list: pagedserve.server.serving.fanout), answered whole."""
    started = time.monotonic()
    state = request.app[STATE_KEY]
    body = await read_json(request)
    version, asked = _model(request, state, body)
    with admitted(request, version, keep_alive(body)):
        parsed = handler_call(parse_embeddings_request, body)
        req = GenerationRequest(
            parsed.prompts, pooling_sampling_params(), pooling=PoolingParams(), prompt_field="input"
        )
        shaper = EmbeddingsShaper(parsed, asked)
        return await run_generation(request, state, version, req, shaper, started=started, lora=lora(request))


def _model(request: web.Request, state: ServerState, body: dict[str, Any]) -> tuple[ModelVersion, str]:
    """The version an OpenAI body asks for (by its `model`, or by the route's prefix) and the
    name to answer with."""
    asked = body.get("model")
    if "model" in request.match_info:  # the path names the model and version
        version = resolve_version(request, state, request.match_info["model"], request.match_info["version"])
        return version, asked if isinstance(asked, str) else version.name
    if not isinstance(asked, str) or not asked:
        raise ErrorReply(
            400, "'model' is required: the name of a registered model (model or model@version)", param="model"
        )
    return resolve_version(request, state, *handler_call(split_model, asked)), asked


def _shaper(
    request: web.Request,
    version: ModelVersion,
    asked: str,
    parsed: OpenAIRequest | ResponsesRequest,
    inputs: list[EngineInput],
) -> WholeShaper:
    """The reply's shape: a Responses API response, or a (chat) completion with the prompts'
    texts when it echoes them."""
    parser = ToolParser(version.model_config.tool_parser)
    if isinstance(parsed, ResponsesRequest):
        return ResponsesShaper(
            parsed, "resp_" + request[REQUEST_ID_KEY], asked, int(time.time()), parser, StreamFormat.SSE
        )
    route = request.match_info.route.name or ""
    prefix = "chatcmpl-" if route.startswith("chat") else "cmpl-"
    echoed = (
        [i.prompt if i.prompt is not None else version.tokenizer.decode(i.token_ids) for i in inputs]
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
        versions = [resolve_version(request, state, request.match_info["model"], request.match_info["version"])]
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
    version = resolve_version(request, request.app[STATE_KEY], *handler_call(split_model, name))
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
