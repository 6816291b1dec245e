"""The middlewares of the inference and management apps, outermost first:

1. `error_middleware`: a request id, the request metrics, and the ONE place where an exception
   becomes an error reply. The app says how a route's errors look (`Shape`: TorchServe's
   `{"code", "type", "message"}` or OpenAI's `{"error": {...}}`) and which exceptions map to
   which status; anything else is a 500 that names the request id (the traceback goes to the
   log). An exception after a stream's headers went out ends the stream with an error event in
   its own format instead of a second response.
2. `drain_middleware`: 503 once the server drains; 429 for a client address over its share of
   requests in flight; counts the requests being answered.
3. token authorization (`pagedserve.server.common.auth.auth_middleware`).
"""

from __future__ import annotations

import asyncio
import logging
import time
import uuid
from collections.abc import Awaitable, Callable, Sequence
from typing import Any

from aiohttp import web
from aiohttp.web_protocol import RequestPayloadError

from pagedserve.server.common.auth import Unauthorized
from pagedserve.server.serving.connections import BodyReadTimeout
from pagedserve.server.serving.generation import CLIENT_CLOSED, REQUEST_ID_KEY, STATUS_KEY, ErrorReply
from pagedserve.server.serving.limits import TRIM_AFTER_CHARS, release_free_memory
from pagedserve.server.serving.state import Drain
from pagedserve.server.serving.streaming import OPEN_STREAM_KEY

logger = logging.getLogger(__name__)
Handler = Callable[[web.Request], Awaitable[web.StreamResponse]]
# shape(request, code, message, param) -> the error body of that route
Shape = Callable[[web.Request, int, str, "str | None"], dict[str, Any]]
# observe(request, status, seconds): the request metrics
Observe = Callable[[web.Request, int, float], None]
# ((exception types, status or status(exc)[, message template with "{}" for the exception's text]), ...)
ExceptionCodes = Sequence[tuple[Any, ...]]

# aiohttp's own refusals (no route, wrong method, body too large) in words a client can act on.
HTTP_MESSAGES = {
    404: "no route {method} {path}",
    405: "method {method} is not allowed on {path}",
    413: "the request body exceeds max_request_size ({text})",
}


def as_reply(request: web.Request, exc: BaseException, codes: ExceptionCodes) -> ErrorReply | None:
    """The error reply an exception stands for, or None (a bug: 500)."""
    if isinstance(exc, ErrorReply):
        return exc
    if isinstance(exc, Unauthorized):
        return ErrorReply(401, str(exc), {"WWW-Authenticate": "Bearer"})
    if isinstance(exc, BodyReadTimeout):
        return ErrorReply(408, str(exc))
    if isinstance(exc, RequestPayloadError):  # e.g. a body that does not follow its Content-Encoding
        reason = " ".join(str(exc).rpartition("message:")[2].split())  # aiohttp's "400, message: ..."
        return ErrorReply(400, f"the request body cannot be read: {reason}")
    if isinstance(exc, web.HTTPException):
        template = HTTP_MESSAGES.get(exc.status)
        message = template.format(method=request.method, path=request.path, text=exc.text) if template else exc.reason
        headers = {"Allow": exc.headers["Allow"]} if "Allow" in exc.headers else None
        return ErrorReply(exc.status, message, headers)
    for types, code, *formats in codes:
        if isinstance(exc, types):
            code = code(exc) if callable(code) else code
            message = formats[0].format(exc) if formats else str(exc)
            return ErrorReply(code, message, {"Retry-After": "1"} if code == 503 else None)
    return None


def error_middleware(shape: Shape, codes: ExceptionCodes, observe: Observe):
    @web.middleware
    async def middleware(request: web.Request, handler: Handler) -> web.StreamResponse:
        started = time.monotonic()
        request_id = uuid.uuid4().hex
        request[REQUEST_ID_KEY] = request_id
        status = 500
        try:
            try:
                response = await handler(request)
            except (asyncio.CancelledError, ConnectionError):
                raise
            except Exception as exc:
                reply = as_reply(request, exc, codes)
                if reply is None:
                    logger.exception("request %s (%s %s) failed", request_id, request.method, request.path)
                    reply = ErrorReply(500, f"internal error (request {request_id}); see the server log")
                try:
                    response = await _answer(request, reply, shape)
                finally:
                    # `reply` may be `exc`, whose traceback holds this frame: a cycle that kept
                    # the request (its body: 6 MB prompts) alive until a full collection.
                    del reply
            status = request.get(STATUS_KEY, response.status)
            if not response.prepared:
                response.headers.setdefault("x-request-id", request_id)
            return response
        except (asyncio.CancelledError, ConnectionError):
            status = CLIENT_CLOSED
            raise
        finally:
            observe(request, status, time.monotonic() - started)
            if (request.content_length or 0) > TRIM_AFTER_CHARS:
                # A large body's buffers (read, decoded, checked) are free now; glibc keeps them
                # in the heap unless asked.
                release_free_memory()

    return middleware


async def _answer(request: web.Request, reply: ErrorReply, shape: Shape) -> web.StreamResponse:
    body = shape(request, reply.code, str(reply), reply.param)
    stream = request.get(OPEN_STREAM_KEY)
    if stream is None:
        return web.json_response(body, status=reply.code, headers=reply.headers)
    # The headers (200) went out already: end the stream with an error event in its format
    # (`{"error": ...}` as an NDJSON line or an SSE event).
    request[STATUS_KEY] = reply.code
    await stream.fail(body if "error" in body else {"error": body})
    return stream.response


def drain_middleware(drain: Drain, exempt: frozenset[str] = frozenset()):
    """503 (Retry-After) for new requests once the server drains; 429 (Retry-After) for a
    client address over its share of requests in flight; the others are counted so the drain
    knows when the last one ended. A request cut when the drain's grace is over ends as a 503
    (on an open stream: an error event, then `[DONE]`). Paths in `exempt` (health checks) pass
    uncounted."""

    @web.middleware
    async def middleware(request: web.Request, handler: Handler) -> web.StreamResponse:
        if request.path in exempt:
            return await handler(request)
        if drain.draining:
            raise ErrorReply(503, "the server is shutting down", {"Retry-After": "5"})
        client = request.remote or ""
        if (refusal := drain.over_share(client)) is not None:
            raise ErrorReply(429, refusal, {"Retry-After": "1"})
        with drain.track(client):
            try:
                return await handler(request)
            except asyncio.CancelledError:
                task = asyncio.current_task()
                if not drain.cutting or task is None or request.transport is None:
                    raise
                if hasattr(task, "uncancel"):  # Python 3.11+: the cancellation is spent
                    task.uncancel()  # the server cut it and the client is still there: answer
                raise ErrorReply(
                    503, "the server shut down before this request finished (drain_grace); retry", {"Retry-After": "5"}
                ) from None

    return middleware
