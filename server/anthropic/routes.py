"""Anthropic's Messages API on the inference port, over the shared generation path.

  POST /v1/messages               a message (SSE events with `"stream": true`)
  POST /v1/messages/count_tokens  {"input_tokens": N}: the prompt as the model would see it

Auth: the inference token as `x-api-key` (what Anthropic's SDKs send) or a bearer token.
Errors are Anthropic's `{"type": "error", "error": {"type", "message"}}` (pagedserve.server.app.inference
shapes them by route).
"""

from __future__ import annotations

import asyncio
import time

from aiohttp import web

from pagedserve.engine.request.inputs import EngineInput, InvalidInput
from pagedserve.handlers.base_handler import HandlerError
from pagedserve.handlers.openai_protocol import split_model
from pagedserve.handlers.openai_tools import ToolParser, tool_prompt
from pagedserve.handlers.tool_tags import with_tool_constraint
from pagedserve.server.anthropic.schemas import AnthropicRequest, parse_count_tokens, parse_messages
from pagedserve.server.anthropic.shaping import AnthropicShaper
from pagedserve.server.serving.generation import REQUEST_ID_KEY, ErrorReply
from pagedserve.server.serving.generation_request import GenerationRequest, run_generation
from pagedserve.server.serving.request_scope import admitted, handler_call, lora, read_json, resolve
from pagedserve.server.serving.state import STATE_KEY

routes = web.RouteTableDef()


@routes.post("/v1/messages", name="anthropic_messages")
async def messages(request: web.Request) -> web.StreamResponse:
    """Anthropic's Messages API."""
    started = time.monotonic()
    state = request.app[STATE_KEY]
    parsed: AnthropicRequest = handler_call(parse_messages, await read_json(request))
    version = resolve(request, state, *handler_call(split_model, parsed.model))
    with admitted(request, version, None):
        spec = tool_prompt(parsed.prompt, parsed.tools, getattr(version.tokenizer, "chat_template", None))
        parser = ToolParser(version.model_config.tool_parser)
        req = GenerationRequest([spec], with_tool_constraint(parsed.params, parsed.tools, parser), parsed.stream)

        def shaper(inputs: list[EngineInput]) -> AnthropicShaper:
            return AnthropicShaper(
                parsed.model,
                len(inputs[0].token_ids),
                parsed.tools,
                parser,
                "msg_" + request[REQUEST_ID_KEY],
            )

        return await run_generation(request, state, version, req, shaper, started=started, lora=lora(request))


@routes.post("/v1/messages/count_tokens", name="anthropic_count_tokens")
async def count_tokens(request: web.Request) -> web.Response:
    """The prompt's tokens under the model's chat template (tools included)."""
    state = request.app[STATE_KEY]
    parsed: AnthropicRequest = handler_call(parse_count_tokens, await read_json(request))
    version = resolve(request, state, *handler_call(split_model, parsed.model))
    spec = tool_prompt(parsed.prompt, parsed.tools, getattr(version.tokenizer, "chat_template", None))
    limit = version.max_model_len or (1 << 20)
    loop = asyncio.get_running_loop()
    try:
        _, token_ids = await loop.run_in_executor(
            state.executor, state.limits.prompts.tokenize, version.tokenizer, spec, limit
        )
    except InvalidInput as exc:
        raise ErrorReply(400, str(exc), param=exc.field) from None
    except HandlerError as exc:
        raise ErrorReply.from_handler_error(exc) from None
    return web.json_response({"input_tokens": len(token_ids)})
