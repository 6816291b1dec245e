"""One generation request, from a checked body to the bytes on the wire.

`prepare` tokenizes off the event loop and picks a worker; `respond` runs the request on it and
answers whole (JSON) or streamed (SSE / NDJSON). A `Shaper` decides what the bodies look like
(/predictions or OpenAI); this module decides when they are sent and what happens when things
go wrong:

- an error before the first byte (the engine refuses the prompt, the worker is dead) is an
  ordinary JSON error reply with its status;
- an error after the stream opened (the worker died, the response grew too large) ends the
  stream with an error event;
- a client that goes away (a failed write, a closed transport, a cancelled handler) closes the
  engine's async iterator, which aborts the request in the engine and frees its blocks.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from dataclasses import dataclass
from typing import Any, Protocol

from aiohttp import web

from engine.async_llm import AsyncLLM, EngineDeadError
from engine.outputs import RequestOutput
from engine.sampling_params import SamplingParams
from handlers.base_handler import HandlerError
from handlers.deltas import ChoiceDelta, DeltaTracker
from handlers.llm_input import PromptSpec, check_fits, render_prompt
from server.registry import ModelVersion
from server.state import ServerState
from server.streaming import (
    ChunkStream,
    ResponseTooLarge,
    StreamFormat,
    check_size,
    encode_json,
)

logger = logging.getLogger(__name__)

# Status recorded for a request whose client went away (nginx's convention; never sent).
CLIENT_CLOSED = 499
STATUS_KEY = web.RequestKey("pagedserve_status", int)  # overrides the status the metrics see
REQUEST_ID_KEY = web.RequestKey("pagedserve_request_id", str)
MODEL_KEY = web.RequestKey("pagedserve_model", str)


class ErrorReply(Exception):
    """A request that ends with an error reply of `code` (any layer may raise it)."""

    def __init__(self, code: int, message: str, headers: dict[str, str] | None = None,
                 param: str | None = None) -> None:
        super().__init__(message)
        self.code = code
        self.headers = headers or {}
        self.param = param

    @classmethod
    def from_handler_error(cls, exc: HandlerError) -> ErrorReply:
        return cls(exc.code, str(exc), param=exc.param)


class Shaper(Protocol):
    """The bodies of one endpoint's replies."""

    stream_format: StreamFormat

    def whole(self, out: RequestOutput, total_s: float) -> dict[str, Any]: ...
    def opening(self, n: int) -> dict[str, Any] | None: ...
    def chunk(self, deltas: list[ChoiceDelta]) -> dict[str, Any]: ...
    def closing(self, deltas: list[ChoiceDelta], out: RequestOutput, total_s: float) -> list[dict[str, Any]]: ...
    def error(self, code: int, message: str) -> dict[str, Any]: ...


@dataclass(slots=True)
class Prepared:
    worker: AsyncLLM
    prompt: str | None
    token_ids: list[int]
    params: SamplingParams


async def prepare(state: ServerState, version: ModelVersion, spec: PromptSpec,
                  params: SamplingParams) -> Prepared:
    """Tokenize (in the thread pool), pick the least loaded worker, apply the length rules."""
    loop = asyncio.get_running_loop()
    try:
        text, token_ids = await loop.run_in_executor(state.executor, render_prompt, version.tokenizer, spec)
    except HandlerError as exc:
        raise ErrorReply.from_handler_error(exc) from None
    worker = version.pick_worker()
    info = worker.info
    try:
        check_fits(token_ids, params, info.max_model_len if info else version.max_model_len,
                   info.vocab_size if info else None)
        worker.validate(token_ids, params)
    except HandlerError as exc:
        raise ErrorReply.from_handler_error(exc) from None
    except ValueError as exc:
        raise ErrorReply(400, str(exc)) from None
    return Prepared(worker, text, token_ids, params)


async def respond(request: web.Request, state: ServerState, version: ModelVersion, job: Prepared,
                  shaper: Shaper, *, stream: bool, started: float) -> web.StreamResponse:
    request_id = request[REQUEST_ID_KEY]
    outputs = job.worker.generate(request_id, job.token_ids, job.params, prompt=job.prompt,
                                  arrival_time=started)
    async with contextlib.aclosing(outputs):
        try:
            first = await _next(outputs)
        except ValueError as exc:  # the engine refused the request after all
            raise ErrorReply(400, str(exc)) from None
        except EngineDeadError as exc:
            raise ErrorReply(503, f"the worker died before answering: {exc}", {"Retry-After": "1"}) from None
        try:
            if stream:
                return await _stream(request, state, version, outputs, first, shaper, job.params, started)
            return await _collect(request, state, version, outputs, first, shaper, started)
        except ConnectionError:  # the client went away; leaving the `async with` aborts the request
            request[STATUS_KEY] = CLIENT_CLOSED  # (a stream returns its own response, see _stream)
            return web.Response(status=CLIENT_CLOSED)


async def _next(outputs) -> RequestOutput:
    try:
        return await anext(outputs)
    except StopAsyncIteration:
        raise EngineDeadError("the request ended without an output") from None


async def _collect(request: web.Request, state: ServerState, version: ModelVersion, outputs,
                   out: RequestOutput, shaper: Shaper, started: float) -> web.Response:
    try:
        while not out.finished:
            _check_connected(request)
            out = await _next(outputs)
    except EngineDeadError as exc:
        raise ErrorReply(503, f"the worker died while generating: {exc}", {"Retry-After": "1"}) from None
    state.metrics.observe_output(version.name, out)
    try:
        body = check_size(encode_json(shaper.whole(out, time.monotonic() - started)),
                          state.config.max_response_size)
    except ResponseTooLarge as exc:
        raise ErrorReply(413, str(exc)) from None
    return web.Response(body=body, content_type="application/json",
                        headers={"x-request-id": request[REQUEST_ID_KEY]})


async def _stream(request: web.Request, state: ServerState, version: ModelVersion, outputs,
                  out: RequestOutput, shaper: Shaper, params: SamplingParams,
                  started: float) -> web.StreamResponse:
    stream = ChunkStream(request, shaper.stream_format, state.config.max_response_size,
                         {"x-request-id": request[REQUEST_ID_KEY]})
    await stream.open()
    tracker = DeltaTracker(params.stop)
    try:
        opening = shaper.opening(len(out.outputs))
        if opening is not None:
            await stream.send(opening)
        while True:
            deltas = tracker.update(out)
            if out.finished:
                state.metrics.observe_output(version.name, out)
                for chunk in shaper.closing(deltas, out, time.monotonic() - started):
                    await stream.send(chunk)
                break
            if deltas:
                await stream.send(shaper.chunk(deltas))
            out = await _next(outputs)
    except EngineDeadError as exc:
        request[STATUS_KEY] = 503
        await _end_with_error(stream, shaper.error(503, f"the worker died while generating: {exc}"))
        return stream.response
    except ResponseTooLarge as exc:
        request[STATUS_KEY] = 413
        await _end_with_error(stream, shaper.error(413, str(exc)))
        return stream.response
    except ConnectionError:  # the client went away: the caller's `async with` aborts the request
        request[STATUS_KEY] = CLIENT_CLOSED
        return stream.response
    with contextlib.suppress(ConnectionError):
        await stream.close()
    return stream.response


async def _end_with_error(stream: ChunkStream, event: dict[str, Any]) -> None:
    with contextlib.suppress(ConnectionError):
        await stream.send_error(event)
        await stream.close(done_marker=False)


def _check_connected(request: web.Request) -> None:
    transport = request.transport
    if transport is None or transport.is_closing():
        raise ConnectionResetError("the client closed the connection")
