"""Compressed request bodies over raw sockets against an in-process server (issue 11: no request
can stall the server). A body that fails to decompress only at its end (deflate b"1") and
arrives in a later packet than its headers made aiohttp 3.14 queue the error as a new message
while the route waited for ever on the body; it must be a prompt 400 naming the encoding, as it
is when headers and body come in one piece, the connection must serve its next request (issue
34: the app decodes, pagedserve.server.serving.body_encoding), and a valid compressed body must still be read."""

from __future__ import annotations

import gzip
import json
import socket
import time
import zlib

import pytest

BODY = json.dumps({"model": "no-such-model", "prompt": "x"}).encode()
# gzip's 10-byte header, then a deflate block of the reserved type 3 (0xff): invalid data.
GZIP_JUNK = gzip.compress(BODY)[:10] + b"\xff" * 6
BAD_BODIES = [("deflate", b"1"), ("deflate", b"12345"), ("gzip", GZIP_JUNK)]
ROUTES = [("inference", "/v1/completions"), ("management", "/models")]
CLIENT_TIMEOUT_S = 20.0  # far below body_read_timeout: a stalled read fails the test
PAUSE_S = 0.2  # between headers and body, so that they arrive in separate packets


@pytest.fixture(scope="module")
def server(inprocess_factory):
    # No model: decoding the body is the front end's own work. body_read_timeout far above the
    # client's timeout, so that a read that waits for ever is not rescued by the 408.
    return inprocess_factory(body_read_timeout=120, enable_model_api=True)


def exchange(server, api: str, path: str, encoding: str, body: bytes, split: bool, keep_alive: bool = False) -> bytes:
    """POST `body` with its Content-Encoding on a fresh connection; everything the server sends
    until it closes the connection (asked to with Connection: close unless `keep_alive`)."""
    close = "" if keep_alive else "Connection: close\r\n"
    head = (
        f"POST {path} HTTP/1.1\r\nHost: 127.0.0.1\r\nAuthorization: Bearer {server.keys[api]}\r\n"
        f"Content-Type: application/json\r\nContent-Encoding: {encoding}\r\n"
        f"Content-Length: {len(body)}\r\n{close}\r\n"
    ).encode()
    with socket.create_connection(("127.0.0.1", server.ports[api]), timeout=CLIENT_TIMEOUT_S) as sock:
        if split:
            sock.sendall(head)
            time.sleep(PAUSE_S)
            sock.sendall(body)
        else:
            sock.sendall(head + body)
        chunks = []
        try:
            while chunk := sock.recv(65536):
                chunks.append(chunk)
        except TimeoutError:
            pytest.fail(
                f"no reply within {CLIENT_TIMEOUT_S:.0f}s (stall); got {b''.join(chunks)!r}\n{server.log_tail(30)}"
            )
    return b"".join(chunks)


def read_reply(sock: socket.socket) -> tuple[bytes, bytes]:
    """One HTTP reply with a Content-Length: (status line and headers, body)."""
    data = b""
    while b"\r\n\r\n" not in data:
        chunk = sock.recv(65536)
        assert chunk, f"the server closed the connection; got {data!r}"
        data += chunk
    head, _, body = data.partition(b"\r\n\r\n")
    length = int(
        next(line.split(b":")[1] for line in head.split(b"\r\n") if line.lower().startswith(b"content-length:"))
    )
    while len(body) < length:
        chunk = sock.recv(65536)
        assert chunk, "the server closed the connection mid-reply"
        body += chunk
    return head, body


@pytest.mark.parametrize("api, path", ROUTES)
@pytest.mark.parametrize("encoding, body", BAD_BODIES, ids=["deflate-1", "deflate-12345", "gzip-junk"])
def test_a_bad_body_after_its_headers_is_a_prompt_400_and_the_connection_serves_on(server, api, path, encoding, body):
    head = (
        f"POST {path} HTTP/1.1\r\nHost: 127.0.0.1\r\nAuthorization: Bearer {server.keys[api]}\r\n"
        f"Content-Type: application/json\r\nContent-Encoding: {encoding}\r\n"
        f"Content-Length: {len(body)}\r\n\r\n"
    ).encode()
    with socket.create_connection(("127.0.0.1", server.ports[api]), timeout=CLIENT_TIMEOUT_S) as sock:
        sock.sendall(head)
        time.sleep(PAUSE_S)  # headers and body in separate packets
        sock.sendall(body)
        status, reply = read_reply(sock)
        assert status.startswith(b"HTTP/1.1 400"), status
        payload = json.loads(reply)
        message = payload["error"]["message"] if path.startswith("/v1") else payload["message"]
        assert "body" in message and encoding in message, message
        # The parser stayed in step with the connection: the next request on it is answered.
        probe = "/ping" if api == "inference" else "/models"
        sock.sendall(
            f"GET {probe} HTTP/1.1\r\nHost: 127.0.0.1\r\nAuthorization: Bearer {server.keys[api]}\r\n\r\n".encode()
        )
        status, _ = read_reply(sock)
        assert status.startswith(b"HTTP/1.1 200"), status


@pytest.mark.parametrize("encoding, body", BAD_BODIES, ids=["deflate-1", "deflate-12345", "gzip-junk"])
def test_a_bad_body_with_its_headers_is_a_400(server, encoding, body):
    reply = exchange(server, "inference", "/v1/completions", encoding, body, split=False)
    assert reply.startswith((b"HTTP/1.1 400", b"HTTP/1.0 400")), reply[:300]


@pytest.mark.parametrize("split", [True, False], ids=["split", "together"])
@pytest.mark.parametrize("encoding", ["deflate", "gzip"])
def test_a_valid_compressed_body_is_read(server, encoding, split):
    body = (zlib.compress if encoding == "deflate" else gzip.compress)(BODY)
    reply = exchange(server, "inference", "/v1/completions", encoding, body, split=split)
    # The body was decoded: the reply is about the model it names, not about the body.
    assert reply.startswith(b"HTTP/1.1 404"), reply[:300]
    assert b"no-such-model" in reply, reply[:600]
