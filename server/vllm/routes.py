"""vLLM's extra routes on the inference port, answered as vLLM's OpenAI server answers them.

  POST /tokenize    {"model", "prompt"} or {"model", "messages", "add_generation_prompt"}
                    -> {"count", "max_model_len", "tokens"} (the chat template applied to messages)
  POST /detokenize  {"model", "tokens"} -> {"prompt"}
  GET  /version     {"version"}: pagedserve's
  GET  /health      200 (empty) while every version that should serve can; 503 otherwise

Errors are OpenAI-shaped, as on /v1/* (pagedserve.server.app.inference shapes them by route).
"""

from __future__ import annotations

import asyncio
from importlib.metadata import PackageNotFoundError
from importlib.metadata import version as package_version
from typing import Annotated, Any

import msgspec
from aiohttp import web
from msgspec import Meta

from pagedserve.engine.request.inputs import InvalidInput, PromptSpec
from pagedserve.engine.sampling.params import TokenId
from pagedserve.handlers.base_handler import HandlerError
from pagedserve.handlers.llm_input import ChatMessages, chat_messages, convert_body
from pagedserve.handlers.openai_protocol import split_model
from pagedserve.server.serving.generation import ErrorReply
from pagedserve.server.serving.request_scope import handler_call, read_json, resolve
from pagedserve.server.serving.state import STATE_KEY
from pagedserve.server.workers.version import ModelVersion

routes = web.RouteTableDef()


class TokenizeBody(msgspec.Struct, forbid_unknown_fields=True, kw_only=True):
    model: Annotated[str, Meta(min_length=1)]
    prompt: str | None = None
    messages: ChatMessages | None = None
    add_generation_prompt: bool = True
    add_special_tokens: bool = False
    return_token_strs: bool = False


class DetokenizeBody(msgspec.Struct, forbid_unknown_fields=True, kw_only=True):
    model: Annotated[str, Meta(min_length=1)]
    tokens: list[TokenId]


@routes.post("/tokenize", name="tokenize")
async def tokenize(request: web.Request) -> web.Response:
    """A prompt's (or chat messages') token ids under the model's tokenizer."""
    state = request.app[STATE_KEY]
    req: TokenizeBody = handler_call(lambda b: convert_body(b, TokenizeBody), await read_json(request))
    if (req.prompt is None) == (req.messages is None):
        raise ErrorReply(400, "give exactly one of 'prompt' or 'messages'", param="prompt")
    version = resolve(request, state, *handler_call(split_model, req.model))
    if req.messages is not None:
        spec = PromptSpec(
            messages=handler_call(chat_messages, req.messages), add_generation_prompt=req.add_generation_prompt
        )
    else:
        spec = PromptSpec(text=req.prompt)
    limit = _max_model_len(version)
    loop = asyncio.get_running_loop()
    try:
        _, tokens = await loop.run_in_executor(
            state.executor, state.limits.prompts.tokenize, version.tokenizer, spec, limit
        )
    except InvalidInput as exc:
        raise ErrorReply(400, str(exc), param=exc.field) from None
    except HandlerError as exc:
        raise ErrorReply.from_handler_error(exc) from None
    if req.add_special_tokens and getattr(version.tokenizer, "bos_token_id", None) is not None and req.messages is None:
        tokens = [version.tokenizer.bos_token_id, *tokens]
    body: dict[str, Any] = {"count": len(tokens), "max_model_len": limit, "tokens": tokens, "token_strs": None}
    if req.return_token_strs:
        body["token_strs"] = version.tokenizer.convert_ids_to_tokens(tokens)
    return web.json_response(body)


@routes.post("/detokenize", name="detokenize")
async def detokenize(request: web.Request) -> web.Response:
    """Token ids -> text."""
    state = request.app[STATE_KEY]
    req: DetokenizeBody = handler_call(lambda b: convert_body(b, DetokenizeBody), await read_json(request))
    version = resolve(request, state, *handler_call(split_model, req.model))
    vocab = len(version.tokenizer)
    bad = [t for t in req.tokens if t >= vocab]
    if bad:
        raise ErrorReply(400, f"tokens: ids out of the vocabulary [0, {vocab}): {bad[:5]}", param="tokens")
    loop = asyncio.get_running_loop()
    text = await loop.run_in_executor(state.executor, version.tokenizer.decode, req.tokens)
    return web.json_response({"prompt": text})


@routes.get("/version", name="vllm_version")
async def version_route(request: web.Request) -> web.Response:
    """pagedserve's version."""
    try:
        found = package_version("pagedserve")
    except PackageNotFoundError:
        found = "unknown"
    return web.json_response({"version": found})


@routes.get("/health", name="health")
async def health(request: web.Request) -> web.Response:
    """vLLM's health check: 200 with no body when serving, 503 otherwise."""
    return web.Response(status=200 if request.app[STATE_KEY].serving() else 503)


def _max_model_len(version: ModelVersion) -> int | None:
    infos = [w.info for w in version.workers() if w.info is not None]
    return infos[0].max_model_len if infos else version.max_model_len
