"""Ollama's API on the inference port, over the shared generation path (pagedserve.server.serving.generation).

  POST /api/generate   a prompt (the chat template applied unless `raw`); an empty prompt only
                       loads the model (`keep_alive: 0`: unloads it), as Ollama does
  POST /api/chat       messages, `tools`, `format`; NDJSON stream unless `"stream": false`
  POST /api/embed      `input` (a string or a list) -> `embeddings`; /api/embeddings: the older
                       `prompt` -> `embedding`
  GET  /api/tags       every model (`name:latest` is its default version, `name:version` each one)
  POST /api/show       a model's details, its chat template, `parameters` (num_ctx,
                       default_max_tokens) and `capabilities`
  GET  /api/ps         the versions with a ready worker: size, context length, keep-alive expiry
  GET  /api/version
  POST /api/pull       nothing is ever downloaded: a registered model answers success, any other
                       a 404 that says how to register one; /api/create, /api/copy, /api/push and
                       DELETE /api/delete answer 403 pointing at the management API

A name is `model`, `model:tag` (`latest`: the default version; otherwise a version) or
`model@version`. `keep_alive` (seconds, a duration, 0, -1) drives the memory budget's
keep-alive (pagedserve.server.workers.lifecycle) for versions loaded on demand. Errors are Ollama's
`{"error": "..."}` with the HTTP status (pagedserve.server.app.inference shapes them by route).
"""

from __future__ import annotations

import hashlib
import json
import time
from typing import Any

from aiohttp import web

from pagedserve.engine.request.inputs import EngineInput, PromptSpec, pooling_sampling_params
from pagedserve.engine.request.pooling import PoolingParams
from pagedserve.handlers.openai_protocol import split_model
from pagedserve.handlers.openai_tools import ToolParser, tool_prompt
from pagedserve.handlers.tool_tags import with_tool_constraint
from pagedserve.server.ollama.schemas import (
    EmbedBody,
    EmbeddingsBody,
    ModelBody,
    OllamaRequest,
    decode,
    parse_chat,
    parse_generate,
)
from pagedserve.server.ollama.shaping import EmbedShaper, OllamaShaper, now_iso
from pagedserve.server.serving.generation import ErrorReply
from pagedserve.server.serving.generation_request import GenerationRequest, run_generation
from pagedserve.server.serving.request_scope import admitted, handler_call, keep_alive, lora, read_json, resolve
from pagedserve.server.serving.state import STATE_KEY, ServerState
from pagedserve.server.workers.lifecycle import state_of
from pagedserve.server.workers.version import ModelVersion

OLLAMA_VERSION = "0.12.0"  # the Ollama API version these routes follow
routes = web.RouteTableDef()


def error_body(message: str) -> dict[str, Any]:
    """Ollama's error shape."""
    return {"error": message}


# -- generation ------------------------------------------------------------------------------


@routes.post("/api/generate", name="ollama_generate")
async def generate(request: web.Request) -> web.StreamResponse:
    """A completion of `prompt`; NDJSON chunks unless `"stream": false`."""
    return await _generate(request, parse_generate, chat=False)


@routes.post("/api/chat", name="ollama_chat")
async def chat(request: web.Request) -> web.StreamResponse:
    """The assistant's next message; NDJSON chunks unless `"stream": false`."""
    return await _generate(request, parse_chat, chat=True)


async def _generate(request: web.Request, parse, *, chat: bool) -> web.StreamResponse:
    started = time.monotonic()
    state = request.app[STATE_KEY]
    body = await read_json(request)
    seconds = keep_alive(body)
    parsed: OllamaRequest = handler_call(parse, body)
    version = _version_of(request, state, parsed.model)
    with admitted(request, version, seconds):
        was_loaded = bool(version.pool.ready_engines())
        if parsed.prompt is None:  # load (or with keep_alive 0, unload): no generation
            return await _load_only(state, version, parsed.model, seconds, started)
        _check_num_ctx(parsed.num_ctx, version)
        spec = parsed.prompt
        if chat:
            spec = tool_prompt(spec, parsed.tools, getattr(version.tokenizer, "chat_template", None))
        parser = ToolParser(version.model_config.tool_parser)
        req = GenerationRequest([spec], with_tool_constraint(parsed.params, parsed.tools, parser), parsed.stream)

        def shaper(inputs: list[EngineInput]) -> OllamaShaper:  # made once the model is loaded
            load_s = 0.0 if was_loaded else time.monotonic() - started
            return OllamaShaper(parsed.model, chat, load_s, parsed.tools, parser)

        return await run_generation(request, state, version, req, shaper, started=started, lora=lora(request))


async def _load_only(
    state: ServerState, version: ModelVersion, model: str, seconds: float | None, started: float
) -> web.Response:
    """An empty /api/generate prompt: load the model, or with keep_alive 0 let it go (the
    keep-alive expiry set when this request ends unloads it)."""
    unloading = seconds == 0
    if not unloading:
        await state.registry.ready_worker(version)
    return web.json_response(
        {
            "model": model,
            "created_at": now_iso(),
            "response": "",
            "done": True,
            "done_reason": "unload" if unloading else "load",
            "load_duration": int((time.monotonic() - started) * 1e9),
        }
    )


def _check_num_ctx(num_ctx: int | None, version: ModelVersion) -> None:
    limit = _context_length(version)
    if num_ctx is not None and limit is not None and num_ctx > limit:
        raise ErrorReply(
            400, f"options.num_ctx: {num_ctx} exceeds the model's context length ({limit})", param="options.num_ctx"
        )


# -- embeddings ------------------------------------------------------------------------------


@routes.post("/api/embed", name="ollama_embed")
async def embed(request: web.Request) -> web.StreamResponse:
    """`input` (one string or a list) -> `embeddings`, one vector per input."""
    return await _embed(request, legacy=False)


@routes.post("/api/embeddings", name="ollama_embeddings")
async def embeddings(request: web.Request) -> web.StreamResponse:
    """The older call: `prompt` -> `embedding`."""
    return await _embed(request, legacy=True)


async def _embed(request: web.Request, *, legacy: bool) -> web.StreamResponse:
    started = time.monotonic()
    state = request.app[STATE_KEY]
    body = await read_json(request)
    seconds = keep_alive(body)
    req = handler_call(lambda b: decode(b, EmbeddingsBody if legacy else EmbedBody), body)
    inputs = [req.prompt] if legacy else ([req.input] if isinstance(req.input, str) else list(req.input))
    field = "prompt" if legacy else "input"
    for i, text in enumerate(inputs):
        if not text:
            raise ErrorReply(
                400,
                f"{field}: must not be empty" if len(inputs) == 1 else f"input[{i}]: must not be empty",
                param=field,
            )
    if not legacy and req.dimensions is not None:
        raise ErrorReply(
            400, "dimensions: not supported (the embedding has the model's hidden size)", param="dimensions"
        )
    version = _version_of(request, state, req.model)
    with admitted(request, version, seconds):
        was_loaded = bool(version.pool.ready_engines())
        embed = GenerationRequest(
            [PromptSpec(text=t) for t in inputs], pooling_sampling_params(), pooling=PoolingParams(), prompt_field=field
        )

        def shaper(_: list[EngineInput]) -> EmbedShaper:
            return EmbedShaper(req.model, legacy, 0.0 if was_loaded else time.monotonic() - started)

        return await run_generation(request, state, version, embed, shaper, started=started, lora=lora(request))


# -- models ----------------------------------------------------------------------------------


@routes.get("/api/tags", name="ollama_tags")
async def tags(request: web.Request) -> web.Response:
    """Every model: `name:latest` (its default version) and `name:version` for each version."""
    state = request.app[STATE_KEY]
    models = []
    for model in state.registry.sorted_models():
        named = [("latest", model.versions[model.default_version])] if model.default_version in model.versions else []
        for tag, version in named + sorted(model.versions.items()):
            models.append(
                {
                    "name": f"{model.name}:{tag}",
                    "model": f"{model.name}:{tag}",
                    "modified_at": version.registered_at.isoformat(),
                    "size": _size(state, version),
                    "digest": _digest(version),
                    "details": _details(version),
                }
            )
    return web.json_response({"models": models})


@routes.post("/api/show", name="ollama_show")
async def show(request: web.Request) -> web.Response:
    """A model's details, chat template, parameters and capabilities."""
    state = request.app[STATE_KEY]
    req = handler_call(lambda b: decode(b, ModelBody), await read_json(request))
    version = _version_of(request, state, handler_call(lambda _: req.asked, {}))
    config = _hf_config(version)
    family = config.get("model_type", "llama")
    limit = _context_length(version)
    parameters = {"num_ctx": limit, "default_max_tokens": version.model_config.default_max_tokens}
    info = {
        "general.architecture": family,
        f"{family}.context_length": limit,
        f"{family}.embedding_length": config.get("hidden_size"),
        f"{family}.block_count": config.get("num_hidden_layers"),
    }
    template = getattr(version.tokenizer, "chat_template", None) or ""
    return web.json_response(
        {
            "modelfile": f"# pagedserve model {version.name} version {version.version}\nFROM {version.url}\n"
            + "".join(f"PARAMETER {k} {v}\n" for k, v in parameters.items()),
            "parameters": "\n".join(f"{k} {v}" for k, v in parameters.items()),
            "template": template,
            "details": _details(version),
            "model_info": info,
            "capabilities": ["completion", "tools", "embedding"],
            "license": "",
            "modified_at": version.registered_at.isoformat(),
        }
    )


@routes.get("/api/ps", name="ollama_ps")
async def ps(request: web.Request) -> web.Response:
    """The versions with a ready worker: size, context length and when the keep-alive expires."""
    state = request.app[STATE_KEY]
    lifecycle = state.registry.lifecycle
    models = []
    for version in state.registry.all_versions():
        if state_of(version) != "loaded":
            continue
        size = sum(lifecycle.footprint(version, s).total for s in version.pool.slots)
        expires = lifecycle.describe(version)["expiresAt"] or "0001-01-01T00:00:00Z"  # Ollama's "never"
        name = f"{version.name}:{version.version}"
        models.append(
            {
                "name": name,
                "model": name,
                "size": size,
                "digest": _digest(version),
                "details": _details(version),
                "expires_at": expires,
                "size_vram": 0,
                "context_length": _context_length(version),
            }
        )
    return web.json_response({"models": models})


@routes.get("/api/version", name="ollama_version")
async def version_route(request: web.Request) -> web.Response:
    """The Ollama API version these routes follow."""
    return web.json_response({"version": OLLAMA_VERSION})


@routes.post("/api/pull", name="ollama_pull")
async def pull(request: web.Request) -> web.Response:
    """Nothing is downloaded: a registered model is already here (success), any other is a 404."""
    state = request.app[STATE_KEY]
    req = handler_call(lambda b: decode(b, ModelBody), await read_json(request))
    asked = handler_call(lambda _: req.asked, {})
    try:
        _version_of(request, state, asked)
    except ErrorReply as exc:
        raise ErrorReply(
            404,
            f"pull model {asked!r}: this server never downloads models; register an "
            "archive from its model store with the management API (POST /models?url=...). "
            f"{exc}",
            param="model",
        ) from None
    return web.json_response({"status": "success"})


@routes.post("/api/create", name="ollama_create")
@routes.post("/api/copy", name="ollama_copy")
@routes.post("/api/push", name="ollama_push")
@routes.delete("/api/delete", name="ollama_delete")
async def model_changes(request: web.Request) -> web.Response:
    """Changes to the model set belong to the management API (its own token, allowed_urls)."""
    what = request.path.rsplit("/", 1)[-1]
    raise ErrorReply(
        403,
        f"/api/{what} is not available on the inference port: models are registered, "
        "copied (as versions) and unregistered through the management API "
        "(POST /models?url=..., DELETE /models/{name}/{version}) with its own token",
    )


# -- helpers ---------------------------------------------------------------------------------


def _version_of(request: web.Request, state: ServerState, asked: str) -> ModelVersion:
    """`name`, `name:tag` (latest: the default version) or `name@version`."""
    if "@" in asked:
        return resolve(request, state, *handler_call(split_model, asked))
    name, _, tag = asked.partition(":")
    return resolve(request, state, name, None if tag in ("", "latest") else tag)


def _context_length(version: ModelVersion) -> int | None:
    infos = [w.info for w in version.workers() if w.info is not None]
    return infos[0].max_model_len if infos else version.max_model_len


def _hf_config(version: ModelVersion) -> dict[str, Any]:
    try:
        return json.loads((version.model_dir / "config.json").read_text())
    except (OSError, ValueError):
        return {}


def _size(state: ServerState, version: ModelVersion) -> int:
    return state.registry.lifecycle.sizes(version)[0]  # the weights' bytes


def _digest(version: ModelVersion) -> str:
    return hashlib.sha256(f"{version.name}@{version.version}:{version.url}".encode()).hexdigest()


def _details(version: ModelVersion) -> dict[str, Any]:
    family = _hf_config(version).get("model_type", "llama")
    dtype = version.model_config.handler.get("dtype", "auto")
    return {
        "parent_model": "",
        "format": "safetensors",
        "family": family,
        "families": [family],
        "parameter_size": "",
        "quantization_level": str(dtype),
    }
