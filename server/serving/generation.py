"""One generation request, from a checked body to the bytes on the wire (the routes reach this
through pagedserve.server.serving.generation_request.run_generation).

`prepare` runs the engine's prepare step (pagedserve.engine.request.inputs: tokenize, chat template, validate
against the workers' limits) off the event loop, then picks a worker for the tokens (the
version's router, `pagedserve.server.workers.routing`); `respond` runs the request
on the worker and answers whole (JSON) or streamed (SSE / NDJSON). A `Shaper` decides what the
bodies look like (/predictions or OpenAI); this module decides when they are sent and what
happens when things go wrong:

- an error before the first byte (the engine refuses the prompt, the worker is dead) is an
  ordinary JSON error reply with its status;
- an error after the stream opened (the worker died, the response grew too large) ends the
  stream with an error event;
- a client that goes away (a failed write, a closed transport, a cancelled handler) closes the
  engine's async iterator, which aborts the request in the engine and frees its blocks; a
  `Watchdog` notices a closed transport within WATCH_S even while the request waits for its
  first token;
- a request whose engine gives no new output for longer than its model's responseTimeout
  (a stalled worker) is aborted the same way and answered 504 (a stream: an error event); a
  request that keeps producing tokens is never cut off by the clock (its length is bounded by
  its max_tokens, or the model's default_max_tokens when it names none).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import AsyncGenerator
from dataclasses import dataclass
from typing import Any, Protocol, cast

import msgspec
from aiohttp import web

from pagedserve.engine.core.async_llm import EngineDeadError
from pagedserve.engine.lora.request import LoRARequest
from pagedserve.engine.request.inputs import EngineInput, InputLimits, InvalidInput, PromptSpec, validate_input
from pagedserve.engine.request.outputs import RequestOutput
from pagedserve.engine.request.pooling import PoolingParams
from pagedserve.engine.sampling.params import SamplingParams
from pagedserve.handlers.base_handler import HandlerError
from pagedserve.handlers.deltas import ChoiceDelta, DeltaTracker
from pagedserve.server.serving.limits import LimitRefused, PromptBounds
from pagedserve.server.serving.state import ServerState
from pagedserve.server.serving.streaming import ChunkStream, ResponseTooLarge, StreamFormat, check_size, encode_json
from pagedserve.server.workers.version import ModelVersion

logger = logging.getLogger(__name__)

# Status recorded for a request whose client went away (nginx's convention; never sent).
CLIENT_CLOSED = 499
WATCH_S = 0.5  # how often a waiting request checks that its client is still connected
STATUS_KEY = web.RequestKey("pagedserve_status", int)  # overrides the status the metrics see
REQUEST_ID_KEY = web.RequestKey("pagedserve_request_id", str)
MODEL_KEY = web.RequestKey("pagedserve_model", str)


class ErrorReply(Exception):
    """A request that ends with an error reply of `code` (any layer may raise it)."""

    def __init__(
        self, code: int, message: str, headers: dict[str, str] | None = None, param: str | None = None
    ) -> None:
        super().__init__(message)
        self.code = code
        self.headers = headers or {}
        self.param = param

    @classmethod
    def from_handler_error(cls, exc: HandlerError) -> ErrorReply:
        return cls(exc.code, str(exc), param=exc.param)


class RequestTimeout(Exception):
    """The engine gave no new output (streamed: no next chunk) within the model's responseTimeout."""


class Watchdog:
    """Interrupts a request whose client hung up or whose engine output is overdue.

    Timers on the event loop, not a task per output: the disconnect check runs every WATCH_S;
    the deadline timer re-arms itself lazily from the time of the last output (`per_chunk`
    only names what was overdue: a stream's next chunk, or a whole reply's progress).
    Interrupting makes the request's iterator raise, and leaving it aborts the request.
    """

    def __init__(
        self, request: web.Request, worker: Worker, request_id: str, timeout_s: float, *, per_chunk: bool
    ) -> None:
        self._loop = asyncio.get_running_loop()
        self._request = request
        self._worker = worker
        self._request_id = request_id
        self._timeout_s = timeout_s
        self._per_chunk = per_chunk
        self._last_output = self._loop.time()
        self._deadline = self._loop.call_later(timeout_s, self._check_deadline)
        self._watch = self._loop.call_later(WATCH_S, self._check_client)

    def progressed(self) -> None:
        """An output arrived (a stream's chunk clock starts again)."""
        self._last_output = self._loop.time()

    def stop(self) -> None:
        self._deadline.cancel()
        self._watch.cancel()

    def _check_deadline(self) -> None:
        due = self._last_output + self._timeout_s
        if due > self._loop.time():
            self._deadline = self._loop.call_at(due, self._check_deadline)
            return
        what = "the next chunk took" if self._per_chunk else "the reply made no progress for"
        self._fire(
            RequestTimeout(
                f"{what} longer than the model's responseTimeout ({self._timeout_s:g} s); the request was aborted"
            )
        )

    def _check_client(self) -> None:
        transport = self._request.transport
        if transport is None or transport.is_closing():
            self._fire(ConnectionResetError("the client closed the connection"))
        else:
            self._watch = self._loop.call_later(WATCH_S, self._check_client)

    def _fire(self, error: BaseException) -> None:
        self.stop()
        self._worker.interrupt(self._request_id, error)


class WholeShaper(Protocol):
    """The bodies of one endpoint's whole (not streamed) replies."""

    stream_format: StreamFormat

    def whole(self, out: RequestOutput, total_s: float) -> dict[str, Any]: ...
    def error(self, code: int, message: str) -> dict[str, Any]: ...


class Shaper(WholeShaper, Protocol):
    """The bodies of one endpoint's replies, whole or streamed."""

    def opening(self, n: int) -> dict[str, Any] | list[dict[str, Any]] | None: ...
    def chunk(self, deltas: list[ChoiceDelta]) -> dict[str, Any] | list[dict[str, Any]]: ...
    def closing(self, deltas: list[ChoiceDelta], out: RequestOutput, total_s: float) -> list[dict[str, Any]]: ...


class Worker(Protocol):
    """What runs a prepared request: a worker's AsyncLLM, or a fan-out over several."""

    def generate(
        self, request_id: str, inp: EngineInput, *, arrival_time: float | None = None, priority: int = 0
    ) -> AsyncGenerator[RequestOutput, None]: ...

    def interrupt(self, request_id: str, error: BaseException) -> None: ...


@dataclass(slots=True)
class Prepared:
    worker: Worker
    input: EngineInput


async def prepare(
    state: ServerState,
    version: ModelVersion,
    spec: PromptSpec,
    params: SamplingParams,
    *,
    client: str = "",
    pooling: PoolingParams | None = None,
    lora: LoRARequest | None = None,
    priority: int = 0,
    cache_salt: str | None = None,
    kv_produce: bool = False,
) -> Prepared:
    """The engine's prepare step (pagedserve.engine.request.inputs) with the front end's bounds: the
    structured-output constraint is checked on its own bounded pool (a per-`client` share, a
    time limit), then, in the thread pool, a prompt that cannot fit is refused before it is
    tokenized, and the workers' length rules apply (a worker is loaded or woken first when
    none is ready); then the router picks the worker. With `pooling`, a pooling request
    (pagedserve.engine.request.pooling: the prompt's embedding, no tokens). `lora`: the LoRA adapter the request
    runs under (None: the base model); `priority` and `cache_salt` as vLLM's request fields;
    `kv_produce` (vLLM's kv_transfer_params.do_remote_decode): the prompt's KV is written through
    the KV offload connector before the request finishes (pagedserve.server.workers.disagg)."""
    try:
        if params.structured_outputs is not None:
            await state.limits.grammar.check(client, params.structured_outputs)
    except LimitRefused as exc:
        raise ErrorReply(exc.code, str(exc), exc.headers) from None
    except ValueError as exc:  # a constraint xgrammar cannot parse, or one over a size bound
        raise ErrorReply(400, str(exc), param="structured_outputs") from None
    # loads or wakes a worker when none is ready; the limits are the same on every worker
    limits = (await state.registry.ready_worker(version)).limits
    loop = asyncio.get_running_loop()
    try:
        inp = await loop.run_in_executor(
            state.executor,
            _bounded_prepare,
            state.limits.prompts,
            version.tokenizer,
            spec,
            params,
            limits,
            pooling,
            version.model_config.default_max_tokens,
        )
    except InvalidInput as exc:
        raise ErrorReply(400, str(exc), param=exc.field) from None
    except HandlerError as exc:
        raise ErrorReply.from_handler_error(exc) from None
    inp.lora, inp.priority, inp.cache_salt, inp.kv_produce = lora, priority, cache_salt, kv_produce
    return Prepared(version.pick_worker(inp.token_ids, inp), inp)


def _bounded_prepare(
    bounds: PromptBounds,
    tokenizer,
    spec: PromptSpec,
    params: SamplingParams,
    limits: InputLimits,
    pooling: PoolingParams | None,
    default_max_tokens: int,
) -> EngineInput:
    """`pagedserve.engine.request.inputs.prepare_input` minus the constraint check (done on its own pool), with
    the prompt's character bound before tokenizing. A request that names no token limit gets
    the model's `default_max_tokens`, capped by the context its prompt leaves."""
    text, token_ids = bounds.tokenize(tokenizer, spec, limits.max_model_len)
    if params.max_tokens is None and limits.max_model_len > len(token_ids):
        params = msgspec.structs.replace(
            params, max_tokens=min(default_max_tokens, limits.max_model_len - len(token_ids))
        )
    validate_input(token_ids, params, limits)
    return EngineInput(text, token_ids, params, pooling)


async def respond(
    request: web.Request,
    state: ServerState,
    version: ModelVersion,
    job: Prepared,
    shaper: WholeShaper,
    *,
    stream: bool,
    started: float,
) -> web.StreamResponse:
    """Run the prepared job and answer it: whole, or streamed (`stream`: the shaper is then a
    `Shaper`, one that shapes chunks too)."""
    request_id = request[REQUEST_ID_KEY]
    outputs = job.worker.generate(request_id, job.input, arrival_time=started, priority=job.input.priority)
    watchdog = Watchdog(request, job.worker, request_id, version.model_config.response_timeout, per_chunk=stream)
    try:
        async with contextlib.aclosing(outputs):
            try:
                first = await _next(outputs)
            except EngineDeadError as exc:
                raise ErrorReply(503, f"the worker died before answering: {exc}", {"Retry-After": "1"}) from None
            except RequestTimeout as exc:
                raise ErrorReply(504, str(exc)) from None
            if first.refusal is not None:  # a grammar that failed to compile, a refused prompt
                raise ErrorReply(400, first.refusal)
            if stream:
                return await _stream(
                    request, state, version, outputs, first, cast(Shaper, shaper), job.input.params, started, watchdog
                )
            return await _collect(request, state, version, outputs, first, shaper, started, watchdog)
    except ConnectionError:  # the client went away; leaving the `async with` aborted the request
        request[STATUS_KEY] = CLIENT_CLOSED  # (a stream returns its own response, see _stream)
        return web.Response(status=CLIENT_CLOSED)
    finally:
        watchdog.stop()


async def _next(outputs) -> RequestOutput:
    try:
        return await anext(outputs)
    except StopAsyncIteration:
        raise EngineDeadError("the request ended without an output") from None


async def _collect(
    request: web.Request,
    state: ServerState,
    version: ModelVersion,
    outputs,
    out: RequestOutput,
    shaper: WholeShaper,
    started: float,
    watchdog: Watchdog,
) -> web.Response:
    try:
        while not out.finished:
            out = await _next(outputs)
            watchdog.progressed()
    except EngineDeadError as exc:
        raise ErrorReply(503, f"the worker died while generating: {exc}", {"Retry-After": "1"}) from None
    except RequestTimeout as exc:
        raise ErrorReply(504, str(exc)) from None
    state.metrics.observe_output(version.name, out)
    # Shaped and encoded in the thread pool: a custom handler's postprocess is their code, and
    # a large reply takes a while to encode.
    loop = asyncio.get_running_loop()
    body = await loop.run_in_executor(
        state.executor, _encode_whole, shaper, out, time.monotonic() - started, state.config.max_response_size
    )
    return web.Response(body=body, content_type="application/json", headers={"x-request-id": request[REQUEST_ID_KEY]})


def _encode_whole(shaper: WholeShaper, out: RequestOutput, total_s: float, limit: int) -> bytes:
    try:
        return check_size(encode_json(shaper.whole(out, total_s)), limit)
    except ResponseTooLarge as exc:
        raise ErrorReply(413, str(exc)) from None
    except (TypeError, msgspec.EncodeError) as exc:
        raise ErrorReply(500, f"the reply cannot be encoded as JSON: {exc}") from None


async def _stream(
    request: web.Request,
    state: ServerState,
    version: ModelVersion,
    outputs,
    out: RequestOutput,
    shaper: Shaper,
    params: SamplingParams,
    started: float,
    watchdog: Watchdog,
) -> web.StreamResponse:
    stream = ChunkStream(
        request, shaper.stream_format, state.config.max_response_size, {"x-request-id": request[REQUEST_ID_KEY]}
    )
    await stream.open()
    tracker = DeltaTracker(params.stop)
    try:
        for event in _events(shaper.opening(len(out.outputs))):
            await stream.send(event)
        while True:
            deltas = tracker.update(out)
            if out.finished:
                state.metrics.observe_output(version.name, out)
                for chunk in shaper.closing(deltas, out, time.monotonic() - started):
                    await stream.send(chunk)
                break
            if deltas:
                for event in _events(shaper.chunk(deltas)):
                    await stream.send(event)
            out = await _next(outputs)
            watchdog.progressed()
    except EngineDeadError as exc:
        request[STATUS_KEY] = 503
        await _end_with_error(stream, shaper.error(503, f"the worker died while generating: {exc}"))
        return stream.response
    except RequestTimeout as exc:
        request[STATUS_KEY] = 504
        await _end_with_error(stream, shaper.error(504, str(exc)))
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


def _events(shaped: dict[str, Any] | list[dict[str, Any]] | None) -> list[dict[str, Any]]:
    """A shaper's opening or chunk: one event, several (a list), or none."""
    if shaped is None:
        return []
    return shaped if isinstance(shaped, list) else [shaped]


async def _end_with_error(stream: ChunkStream, event: dict[str, Any]) -> None:
    """The error event, then (in SSE) `[DONE]`: every stream ends the same way."""
    await stream.fail(event)
