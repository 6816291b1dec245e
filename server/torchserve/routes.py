"""TorchServe's inference call on the inference port:

  POST|PUT /predictions/{model}[/{version}]    JSON, text, a form or a raw upload in
                                               (pagedserve.server.torchserve.bodies), JSON out; "stream": true
                                               -> NDJSON chunks (a model with a custom handler:
                                               its preprocess reads the body, its postprocess
                                               writes the reply)

A body is read and checked once, here (pagedserve.handlers.llm_input's schema, or the custom
handler's preprocess), into a `GenerationRequest`, which the shared path runs
(pagedserve.server.serving.generation_request). Errors are TorchServe's `{"code", "type", "message"}`.
"""

from __future__ import annotations

import asyncio
import logging
import time

from aiohttp import web

from pagedserve.handlers.base_handler import BaseHandler, HandlerError
from pagedserve.handlers.llm_input import ParsedBody, parse_predictions_body
from pagedserve.server.serving.generation import REQUEST_ID_KEY, ErrorReply, Shaper
from pagedserve.server.serving.generation_request import GenerationRequest, run_generation
from pagedserve.server.serving.request_scope import adapter_in_flight, handler_call, keep_alive, lora, raw_keep_alive
from pagedserve.server.serving.request_scope import resolve as resolve_version
from pagedserve.server.serving.shapers import HandlerShaper, PredictionShaper
from pagedserve.server.serving.state import STATE_KEY, ServerState
from pagedserve.server.torchserve.bodies import read_predictions_body

PREDICTIONS_CONTENT_TYPES = (
    "application/json",
    "text/plain",
    "multipart/form-data",
    "application/x-www-form-urlencoded",
    "application/octet-stream",
)
routes = web.RouteTableDef()
logger = logging.getLogger(__name__)


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
    version = resolve_version(request, state, request.match_info["model"], request.match_info.get("version"))
    handler = version.handler
    shaper: Shaper
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
        req = GenerationRequest([parsed.prompt], parsed.params, parsed.stream)
        return await run_generation(request, state, version, req, shaper, started=started, lora=lora(request))


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
