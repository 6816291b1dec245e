"""Compressed request bodies (`Content-Encoding: gzip | deflate | br`), decoded by the app, not
by aiohttp's parser.

aiohttp decodes while it parses: a body that is not valid for its encoding becomes a parser
error, the connection's parser state is lost (the connection is reset after the 400, with a
traceback in the log), and an encoding it cannot decode (brotli without the module) is answered
in plain text before any route runs. The runners therefore start with `auto_decompress=False`
(pagedserve.server.app.serve): the parser reads the body's raw bytes, exactly Content-Length or the chunks, so
the connection stays in step whatever the bytes are; `decode_body_middleware` (inside the error
middleware, so that every failure is an error in the route's own shape) decodes them:

- the encoded body is bounded by `client_max_size` (aiohttp's read, 413), the decoded one by
  the same limit (413 naming `max_request_size`: a small "zip bomb" cannot expand in memory);
- invalid data is a 400 naming the encoding; an unknown encoding a 415 naming it;
- several encodings (`gzip, br`) are undone in reverse order, as RFC 9110 says.
"""

from __future__ import annotations

import zlib
from collections.abc import Awaitable, Callable

from aiohttp import web

from pagedserve.server.serving.generation import ErrorReply

try:  # Brotli is a dependency; without it `br` is a 415 rather than a crash
    import brotli
except ImportError:  # pragma: no cover - the package is installed with the server
    brotli = None

Handler = Callable[[web.Request], Awaitable[web.StreamResponse]]
SUPPORTED = ("gzip", "x-gzip", "deflate", "br", "identity")
_CHUNK = 64 * 1024  # input fed to a decompressor at a time


class BodyTooLarge(Exception):
    """The decoded body exceeds the limit."""


def _zlib(data: bytes, wbits: int, limit: int) -> bytes:
    d = zlib.decompressobj(wbits)
    out = d.decompress(data, limit + 1)
    if len(out) > limit:
        raise BodyTooLarge
    if not d.eof:
        raise zlib.error("the compressed data is incomplete")
    if d.unused_data.strip(b"\x00") and wbits > 16:  # gzip members may follow each other
        return out + _zlib(d.unused_data, wbits, limit - len(out))
    return out


def _deflate(data: bytes, limit: int) -> bytes:
    """`deflate` is zlib-wrapped by the RFC, raw deflate by many clients: both are accepted."""
    try:
        return _zlib(data, zlib.MAX_WBITS, limit)
    except zlib.error:
        return _zlib(data, -zlib.MAX_WBITS, limit)


def _brotli(data: bytes, limit: int) -> bytes:
    d = brotli.Decompressor()
    out = bytearray()
    for start in range(0, max(len(data), 1), _CHUNK):
        out += d.process(data[start : start + _CHUNK], output_buffer_limit=limit + 1 - len(out))
        while len(out) <= limit and not d.can_accept_more_data():
            out += d.process(b"", output_buffer_limit=limit + 1 - len(out))
        if len(out) > limit:
            raise BodyTooLarge
    if not d.is_finished():
        raise brotli.error("the compressed data is incomplete")
    return bytes(out)


def decode(data: bytes, encodings: list[str], limit: int) -> bytes:
    """`data` with `encodings` (in the order they were applied) undone; raises `ErrorReply`."""
    for encoding in reversed(encodings):
        try:
            if encoding in ("gzip", "x-gzip"):
                data = _zlib(data, 16 + zlib.MAX_WBITS, limit)
            elif encoding == "deflate":
                data = _deflate(data, limit)
            elif encoding == "br" and brotli is not None:
                data = _brotli(data, limit)
            elif encoding != "identity":
                raise ErrorReply(
                    415, f"Content-Encoding {encoding!r} is not supported (use one of {', '.join(SUPPORTED)})"
                )
        except BodyTooLarge:
            raise ErrorReply(
                413,
                f"the request body exceeds max_request_size ({limit} bytes) "
                f"once decoded (Content-Encoding: {encoding})",
            ) from None
        except (zlib.error, *((brotli.error,) if brotli else ())) as exc:
            raise ErrorReply(
                400, f"the request body cannot be read: not valid {encoding} data (Content-Encoding: {encoding}): {exc}"
            ) from None
    return data


def content_encodings(request: web.Request) -> list[str]:
    header = request.headers.get("Content-Encoding", "")
    return [item.strip().lower() for item in header.split(",") if item.strip()]


@web.middleware
async def decode_body_middleware(request: web.Request, handler: Handler) -> web.StreamResponse:
    """Decode a compressed body before the route reads it (`request.read()` and everything
    built on it: `json()`, `text()`, `post()` return the decoded bytes)."""
    encodings = content_encodings(request)
    if encodings and request.body_exists:
        raw = await request.read()  # encoded size bounded by client_max_size (413)
        # aiohttp keeps the body read once here; the routes' reads get the decoded one.
        request._read_bytes = decode(raw, encodings, request.client_max_size or len(raw) * 1024)
    return await handler(request)
