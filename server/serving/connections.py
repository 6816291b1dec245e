"""Connection limits of one listening port: header and body read timeouts, and a cap on open
connections (a client that opens connections and sends nothing, or half a request, cannot hold
the server's sockets).

- `header_timeout`: a connection must deliver a request's complete headers within this many
  seconds of opening, or of its first byte when it is kept alive between requests; otherwise it
  is closed. An idle kept-alive connection is closed after `keepalive_timeout`.
- `body_timeout`: the body must arrive within this many seconds of its headers; otherwise the
  route's read raises `BodyReadTimeout` (answered 408) and the connection is closed.
- `max_connections`: a connection beyond the cap is answered 503 and closed at once.
- `per_client_connections`: a client address holding this many open connections gets 429 (with
  `Retry-After`) for the next one, closed at once: one client's flood or trickle (slowloris)
  cannot take the port's whole `max_connections` from the others.
- Errors aiohttp's parser answers itself (a malformed request line, oversized headers, a bad
  method) are JSON in the error shape of the path they named (`shape`), not plain text.
- Bodies reach the app undecoded (`auto_decompress=False`; pagedserve.server.serving.body_encoding decodes them),
  so a compressed body that is not valid data is a 400 and the connection serves on. A body
  whose framing itself breaks (bad chunked encoding) after its headers arrived makes aiohttp's
  parser queue the error as a NEW message while the route still waits for the body; the
  handler instead fails that body's read with `RequestPayloadError` (400), drops the error
  message and closes the connection once the reply is sent (the parser's state is lost).

aiohttp has no such limits of its own; `GuardedAppRunner` is an `AppRunner` whose protocol
objects (`GuardedRequestHandler`, a `RequestHandler`) keep the timers.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from aiohttp import web
from aiohttp.web_protocol import RequestHandler, RequestPayloadError, _ErrInfo

from pagedserve.server.common.errors import error_body

KEEPALIVE_TIMEOUT_S = 75.0  # aiohttp's run_app default (AppRunner's own is an hour)
# shape(path, code, message) -> the error body of the API that `path` belongs to
PathShape = Callable[[str, int, str], dict]


def _refusal(status: str, body: bytes) -> bytes:
    return (
        b"HTTP/1.1 %s\r\nContent-Type: application/json\r\nRetry-After: 1\r\n"
        b"Connection: close\r\nContent-Length: %d\r\n\r\n%s" % (status.encode(), len(body), body)
    )


REFUSED = _refusal(
    "503 Service Unavailable",
    b'{"code": 503, "type": "ServiceUnavailableException", "message": "too many connections"}',
)
REFUSED_CLIENT = _refusal(
    "429 Too Many Requests",
    b'{"code": 429, "type": "TooManyRequestsException", "message": "too many connections from '
    b'this client address (max_connections_per_client); close some or retry later"}',
)


class BodyReadTimeout(Exception):
    """The request body did not arrive within body_read_timeout (408)."""


@dataclass(slots=True)
class ConnectionLimits:
    """The limits of one port, and its count of open connections."""

    header_timeout: float
    body_timeout: float
    max_connections: int
    per_client_connections: int | None = None  # None: no cap per client address
    shape: PathShape = lambda path, code, message: error_body(code, message)
    open: int = 0
    by_client: dict[str, int] = field(default_factory=dict)  # open connections per address

    def admit(self, client: str) -> bytes | None:
        """Count a new connection from `client`; the refusal to send instead, if over a cap."""
        if self.open >= self.max_connections:
            return REFUSED
        held = self.by_client.get(client, 0)
        if self.per_client_connections is not None and held >= self.per_client_connections:
            return REFUSED_CLIENT
        self.open += 1
        self.by_client[client] = held + 1
        return None

    def release(self, client: str) -> None:
        self.open -= 1
        held = self.by_client.pop(client, 1) - 1
        if held:
            self.by_client[client] = held


class GuardedRequestHandler(RequestHandler):
    """One connection: aiohttp's protocol plus the header/body timers and the cap."""

    def __init__(self, manager: web.Server, limits: ConnectionLimits, **kwargs: Any) -> None:
        super().__init__(manager, **kwargs)
        self._limits = limits
        self._counted = False
        self._header_timer: asyncio.TimerHandle | None = None
        self._body_timer: asyncio.TimerHandle | None = None
        self._current: tuple[Any, Any] | None = None  # (message, payload) of the latest request
        self._client = ""
        self._target = "/"  # the path the latest request line named (for parser errors' shape)

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        peer = transport.get_extra_info("peername")
        self._client = str(peer[0]) if isinstance(peer, tuple) and peer else str(peer or "")
        refusal = self._limits.admit(self._client)
        if refusal is not None:
            transport.write(refusal)  # type: ignore[attr-defined]
            transport.close()
            return
        self._counted = True
        super().connection_made(transport)
        self._arm_header_timer()

    def connection_lost(self, exc: BaseException | None) -> None:
        if not self._counted:
            return
        self._counted = False
        self._limits.release(self._client)
        self._cancel_timers()
        super().connection_lost(exc)

    def data_received(self, data: bytes) -> None:
        if data and self._header_timer is None and not self._request_in_progress:
            self._arm_header_timer()  # the first byte of the next request on a kept-alive connection
        if data and not self._request_in_progress:
            parts = data.split(b" ", 2)
            if len(parts) > 2:
                self._target = parts[1][:2048].decode("latin-1").partition("?")[0]
        before = self._request_count
        super().data_received(data)
        if self._request_count == before or self._fail_unfinished_body(self._request_count - before):
            return
        # headers complete: a request was parsed
        self._cancel(self._header_timer)
        self._header_timer = None
        self._current = self._messages[-1] if self._messages else None
        _, payload = self._current or (None, None)
        if payload is not None and not payload.is_eof():
            self._cancel(self._body_timer)
            self._body_timer = self._loop.call_later(self._limits.body_timeout, self._body_overdue, payload)

    async def finish_response(self, request, resp, start_time):
        self._cancel(self._body_timer)
        self._body_timer = None
        return await super().finish_response(request, resp, start_time)

    def _fail_unfinished_body(self, new: int) -> bool:
        """Whether the `new` messages just parsed include a parser error that belongs to the
        current request's unfinished body; if so, that body's read fails instead (400) and the
        error message is dropped (its reply would stall behind the route, then follow it)."""
        message, payload = self._current or (None, None)
        if payload is None or payload.is_eof():
            return False
        fresh = list(self._messages)[-new:]
        errors = [item for item in fresh if isinstance(item[0], _ErrInfo)]
        if not errors:
            return False
        for item in errors:
            self._messages.remove(item)
            self._request_count -= 1
        if payload.exception() is None:
            encoding = getattr(message, "compression", None)
            parser_error = next(info.message for info, _ in errors if isinstance(info, _ErrInfo))
            reason = f"not valid {encoding} data (Content-Encoding: {encoding})" if encoding else parser_error
            payload.set_exception(RequestPayloadError(reason))
        self._cancel(self._body_timer)
        self._body_timer = None
        self.close()  # the parser's state is lost: no further request on this connection
        return True

    def handle_error(
        self, request, status: int = 500, exc: BaseException | None = None, message: str | None = None
    ) -> web.StreamResponse:
        """aiohttp's own error replies (parser errors, a handler that raised past the error
        middleware) as JSON in the shape of the API the request named."""
        response = super().handle_error(request, status, exc, message)  # logs; text/plain
        if status >= 500:
            message = "internal error; see the server log"
        text = " ".join(str(message or getattr(exc, "message", "") or response.reason).split())
        reply = web.json_response(self._limits.shape(self._target, status, text), status=status)
        reply.force_close()
        return reply

    def _arm_header_timer(self) -> None:
        self._cancel(self._header_timer)
        self._header_timer = self._loop.call_later(self._limits.header_timeout, self._headers_overdue)

    def _headers_overdue(self) -> None:
        self._header_timer = None
        if not self._request_in_progress:
            self.force_close()
            if self.transport is not None:
                self.transport.close()

    def _body_overdue(self, payload) -> None:
        self._body_timer = None
        if not payload.is_eof():
            payload.set_exception(
                BodyReadTimeout(
                    f"the request body did not arrive within body_read_timeout ({self._limits.body_timeout:g} s)"
                )
            )

    def _cancel_timers(self) -> None:
        self._cancel(self._header_timer)
        self._cancel(self._body_timer)
        self._header_timer = self._body_timer = None

    @staticmethod
    def _cancel(timer: asyncio.TimerHandle | None) -> None:
        if timer is not None:
            timer.cancel()


class GuardedServer(web.Server):
    """aiohttp's low-level server, making `GuardedRequestHandler`s."""

    def __init__(self, base: web.Server, limits: ConnectionLimits, **handler_kwargs: Any) -> None:
        super().__init__(base.request_handler, request_factory=base.request_factory, **handler_kwargs)
        self.limits = limits

    def __call__(self) -> RequestHandler:
        return GuardedRequestHandler(self, self.limits, loop=self._loop, **self._kwargs)


class GuardedAppRunner(web.AppRunner):
    """An `AppRunner` whose connections obey `limits` (run the app's startup as usual)."""

    def __init__(self, app: web.Application, limits: ConnectionLimits, **kwargs: Any) -> None:
        kwargs.setdefault("keepalive_timeout", KEEPALIVE_TIMEOUT_S)
        # Bodies reach the app as sent: pagedserve.server.serving.body_encoding decodes them, so that a body that
        # is not valid for its encoding is a 400 and the connection's parser stays in step.
        kwargs.setdefault("auto_decompress", False)
        super().__init__(app, **kwargs)
        self.limits = limits

    async def _make_server(self) -> web.Server:
        base = await super()._make_server()  # runs the app's startup (cleanup_ctx)
        return GuardedServer(base, self.limits, **self._kwargs)
