"""Connection limits of one listening port: header and body read timeouts, and a cap on open
connections (a client that opens connections and sends nothing, or half a request, cannot hold
the server's sockets).

- `header_timeout`: a connection must deliver a request's complete headers within this many
  seconds of opening, or of its first byte when it is kept alive between requests; otherwise it
  is closed. An idle kept-alive connection is closed after `keepalive_timeout`.
- `body_timeout`: the body must arrive within this many seconds of its headers; otherwise the
  route's read raises `BodyReadTimeout` (answered 408) and the connection is closed.
- `max_connections`: a connection beyond the cap is answered 503 and closed at once.
- A body that fails to decompress only at its end (`Content-Encoding: deflate` b"1"), arriving
  in a later packet than its headers, makes aiohttp's parser queue the error as a NEW message
  while the route still waits for the body; the handler instead fails that body's read with
  `RequestPayloadError` (answered 400 naming the encoding), drops the error message and closes
  the connection once the reply is sent.

aiohttp has no such limits of its own; `GuardedAppRunner` is an `AppRunner` whose protocol
objects (`GuardedRequestHandler`, a `RequestHandler`) keep the timers.
"""

from __future__ import annotations

import asyncio
from dataclasses import dataclass
from typing import Any

from aiohttp import web
from aiohttp.web_protocol import RequestHandler, RequestPayloadError, _ErrInfo

KEEPALIVE_TIMEOUT_S = 75.0  # aiohttp's run_app default (AppRunner's own is an hour)
_REFUSED_BODY = b'{"code": 503, "type": "ServiceUnavailableException", "message": "too many connections"}'
REFUSED = (b"HTTP/1.1 503 Service Unavailable\r\nContent-Type: application/json\r\n"
           b"Retry-After: 1\r\nConnection: close\r\nContent-Length: %d\r\n\r\n%s"
           % (len(_REFUSED_BODY), _REFUSED_BODY))


class BodyReadTimeout(Exception):
    """The request body did not arrive within body_read_timeout (408)."""


@dataclass(slots=True)
class ConnectionLimits:
    """The limits of one port, and its count of open connections."""

    header_timeout: float
    body_timeout: float
    max_connections: int
    open: int = 0


class GuardedRequestHandler(RequestHandler):
    """One connection: aiohttp's protocol plus the header/body timers and the cap."""

    def __init__(self, manager: web.Server, limits: ConnectionLimits, **kwargs: Any) -> None:
        super().__init__(manager, **kwargs)
        self._limits = limits
        self._counted = False
        self._header_timer: asyncio.TimerHandle | None = None
        self._body_timer: asyncio.TimerHandle | None = None
        self._current: tuple[Any, Any] | None = None  # (message, payload) of the latest request

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        if self._limits.open >= self._limits.max_connections:
            transport.write(REFUSED)  # type: ignore[attr-defined]
            transport.close()
            return
        self._limits.open += 1
        self._counted = True
        super().connection_made(transport)
        self._arm_header_timer()

    def connection_lost(self, exc: BaseException | None) -> None:
        if not self._counted:
            return
        self._counted = False
        self._limits.open -= 1
        self._cancel_timers()
        super().connection_lost(exc)

    def data_received(self, data: bytes) -> None:
        if data and self._header_timer is None and not self._request_in_progress:
            self._arm_header_timer()  # the first byte of the next request on a kept-alive connection
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
            self._body_timer = self._loop.call_later(self._limits.body_timeout,
                                                     self._body_overdue, payload)

    async def finish_response(self, request, resp, start_time):  # type: ignore[override]
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
            reason = (f"not valid {encoding} data (Content-Encoding: {encoding})" if encoding
                      else errors[0][0].message)
            payload.set_exception(RequestPayloadError(reason))
        self._cancel(self._body_timer)
        self._body_timer = None
        self.close()  # the parser's state is lost: no further request on this connection
        return True

    def _arm_header_timer(self) -> None:
        self._cancel(self._header_timer)
        self._header_timer = self._loop.call_later(self._limits.header_timeout,
                                                   self._headers_overdue)

    def _headers_overdue(self) -> None:
        self._header_timer = None
        if not self._request_in_progress:
            self.force_close()
            if self.transport is not None:
                self.transport.close()

    def _body_overdue(self, payload) -> None:
        self._body_timer = None
        if not payload.is_eof():
            payload.set_exception(BodyReadTimeout(
                f"the request body did not arrive within body_read_timeout "
                f"({self._limits.body_timeout:g} s)"))

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
        super().__init__(base.request_handler, request_factory=base.request_factory,
                         **handler_kwargs)
        self.limits = limits

    def __call__(self) -> RequestHandler:
        return GuardedRequestHandler(self, self.limits, loop=self._loop, **self._kwargs)


class GuardedAppRunner(web.AppRunner):
    """An `AppRunner` whose connections obey `limits` (run the app's startup as usual)."""

    def __init__(self, app: web.Application, limits: ConnectionLimits, **kwargs: Any) -> None:
        kwargs.setdefault("keepalive_timeout", KEEPALIVE_TIMEOUT_S)
        super().__init__(app, **kwargs)
        self.limits = limits

    async def _make_server(self) -> web.Server:
        base = await super()._make_server()  # runs the app's startup (cleanup_ctx)
        return GuardedServer(base, self.limits, **self._kwargs)
