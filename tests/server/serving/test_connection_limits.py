"""Connection limits on every port (finding 11), with raw sockets against an in-process server:
a connection that sends half its headers is closed after header_read_timeout, a body that
stops arriving is answered 408 after body_read_timeout, and connections beyond
max_connections are refused with 503 while the others keep working."""

from __future__ import annotations

import socket

import pytest

CAP = 4
API_PORTS = ["inference", "management", "metrics"]


@pytest.fixture(scope="module")
def server(inprocess_factory):
    # No model: the limits are the front end's own. Short timeouts so the test is quick; the
    # socket timeouts below are generous (a server that never closes fails the test).
    return inprocess_factory(header_read_timeout=0.5, body_read_timeout=0.5, enable_model_api=True)


@pytest.fixture(scope="module")
def capped(inprocess_factory):
    return inprocess_factory(max_connections=CAP)


def connect(server, api: str) -> socket.socket:
    return socket.create_connection(("127.0.0.1", server.ports[api]), timeout=60)


def read_all(sock: socket.socket) -> bytes:
    """Everything the server sends until it closes the connection."""
    chunks = []
    while chunk := sock.recv(65536):
        chunks.append(chunk)
    return b"".join(chunks)


def open_connections(server, api: str) -> int:
    runner = server.server.runners[API_PORTS.index(api)]
    return runner.limits.open


@pytest.mark.parametrize("api", API_PORTS)
def test_partial_headers_are_closed_after_the_header_timeout(server, api):
    with connect(server, api) as sock:
        sock.sendall(b"GET /ping HTTP/1.1\r\nHost: 127.0.0.1\r\nX-Slow: ")
        assert read_all(sock) == b""  # closed without a reply
    with connect(server, api) as sock:  # a connection that sends nothing at all
        assert read_all(sock) == b""
    server.wait_for(lambda: open_connections(server, api) == 0, 30, what="connections closed")


def test_a_kept_alive_connection_serves_requests_then_times_out_on_half_a_request(server):
    key = server.keys["inference"].encode()
    with connect(server, "inference") as sock:
        for _ in range(2):
            sock.sendall(b"GET /live HTTP/1.1\r\nHost: 127.0.0.1\r\nAuthorization: Bearer " + key + b"\r\n\r\n")
            reply = sock.recv(65536)
            assert reply.startswith(b"HTTP/1.1 200") and b'"Alive"' in reply
        sock.sendall(b"GET /live HTTP/1.1\r\n")  # the next request stalls
        assert read_all(sock) == b""


@pytest.mark.parametrize("api, path", [("inference", "/v1/completions"), ("management", "/models")])
def test_a_body_that_stops_arriving_is_a_408(server, api, path):
    key = server.keys[api]
    with connect(server, api) as sock:
        sock.sendall(
            f"POST {path} HTTP/1.1\r\nHost: 127.0.0.1\r\nAuthorization: Bearer {key}\r\n"
            "Content-Type: application/json\r\nContent-Length: 1000\r\n\r\n".encode()
            + b'{"prompt": "'
        )
        reply = read_all(sock)
    assert reply.startswith(b"HTTP/1.1 408"), reply[:200]
    assert b"body_read_timeout" in reply


@pytest.mark.parametrize("api", API_PORTS)
def test_connections_beyond_the_cap_are_refused_with_503(capped, api):
    server = capped
    held = []
    try:
        for _ in range(CAP):
            sock = connect(server, api)
            held.append(sock)
        server.wait_for(lambda: open_connections(server, api) == CAP, 30, what="the cap reached")
        with connect(server, api) as extra:
            reply = read_all(extra)
        assert reply.startswith(b"HTTP/1.1 503") and b"too many connections" in reply
    finally:
        for sock in held:
            sock.close()
    server.wait_for(lambda: open_connections(server, api) == 0, 30, what="connections closed")
    path = "/metrics" if api == "metrics" else ("/ping" if api == "inference" else "/models")
    assert server.get(api, path).status == 200
