"""Streaming replies: Server-Sent Events (OpenAI routes) and newline-delimited JSON over HTTP
chunked transfer (/predictions), with a cap on the bytes a response may carry.

A write to a client that went away raises `ConnectionError` (aiohttp's
`ClientConnectionResetError` is one); the caller lets it propagate so the engine request is
aborted. Error events bypass the size cap: a stream always ends with its reason (an SSE stream
with the error event, then `[DONE]`). An open
stream is kept on its request (`OPEN_STREAM_KEY`) so that an error after the headers went out
ends it with an error event (`fail`) rather than a second response.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass, field
from typing import Any

import msgspec
from aiohttp import web


class StreamFormat(enum.Enum):
    SSE = "text/event-stream"  # `data: {json}\n\n` ... `data: [DONE]\n\n`
    NDJSON = "application/x-ndjson"  # one JSON object per line, one line per chunk
    # Anthropic's: `event: {type}\ndata: {json}\n\n`, the event named by the object's "type"; no [DONE]
    SSE_EVENTS = "text/event-stream; events"

    @property
    def content_type(self) -> str:
        return self.value.partition(";")[0]


class ResponseTooLarge(Exception):
    """The response would exceed max_response_size."""

    def __init__(self, limit: int) -> None:
        super().__init__(f"the response exceeds max_response_size ({limit} bytes); ask for fewer tokens or choices")
        self.limit = limit


def encode_json(obj: Any) -> bytes:
    return msgspec.json.encode(obj)


def check_size(body: bytes, limit: int) -> bytes:
    if len(body) > limit:
        raise ResponseTooLarge(limit)
    return body


@dataclass(slots=True, eq=False)
class ChunkStream:
    """One streamed reply. `open` sends the headers; `send` one chunk; `close` the end."""

    request: web.Request
    format: StreamFormat
    max_bytes: int
    headers: dict[str, str]
    _response: web.StreamResponse | None = field(default=None, init=False)
    sent_bytes: int = 0

    @property
    def is_open(self) -> bool:
        return self._response is not None

    @property
    def response(self) -> web.StreamResponse:
        """The response, once `open` sent its headers."""
        if self._response is None:
            raise RuntimeError("the stream is not open")
        return self._response

    async def open(self) -> None:
        response = web.StreamResponse(
            status=200,
            headers={
                "Content-Type": self.format.content_type + "; charset=utf-8",
                "Cache-Control": "no-cache",
                "X-Accel-Buffering": "no",  # proxies must not sit on the tokens
                **self.headers,
            },
        )
        response.enable_chunked_encoding()
        await response.prepare(self.request)
        self._response = response
        self.request[OPEN_STREAM_KEY] = self

    async def send(self, obj: Any) -> None:
        data = self._frame(encode_json(obj), obj)
        if self.sent_bytes + len(data) > self.max_bytes:
            raise ResponseTooLarge(self.max_bytes)
        await self._write(data)

    async def send_error(self, obj: Any) -> None:
        """The last event of a stream that failed (never refused for size)."""
        await self._write(self._frame(encode_json(obj), obj))

    async def close(self) -> None:
        if self.format is StreamFormat.SSE:
            await self._write(b"data: [DONE]\n\n")
        await self.response.write_eof()
        self.request.pop(OPEN_STREAM_KEY, None)

    async def fail(self, event: Any) -> None:
        """End the stream with the error `event` (then, in SSE, `[DONE]`: the stream ended, and
        the event before it says it did not finish), if the client is still there."""
        try:
            await self.send_error(event)
            await self.close()
        except ConnectionError:
            self.request.pop(OPEN_STREAM_KEY, None)

    def _frame(self, payload: bytes, obj: Any) -> bytes:
        if self.format is StreamFormat.SSE_EVENTS:
            return b"event: " + str(obj.get("type", "message")).encode() + b"\ndata: " + payload + b"\n\n"
        if self.format is StreamFormat.SSE:
            return b"data: " + payload + b"\n\n"
        return payload + b"\n"

    async def _write(self, data: bytes) -> None:
        transport = self.request.transport
        if transport is None or transport.is_closing():
            raise ConnectionResetError("the client closed the connection")
        self.sent_bytes += len(data)
        await self.response.write(data)


OPEN_STREAM_KEY = web.RequestKey("pagedserve_open_stream", ChunkStream)
