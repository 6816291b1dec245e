"""The inference port's routes in-process (the real server's apps and middlewares, real HTTP,
a real engine worker on the tiny random-weight model): bad input is a 4xx naming the problem
(never a 5xx, and the worker keeps serving), size limits, a full job queue, token authorization
on every route, and the model list."""

from __future__ import annotations

import http.client
import json
import os
import signal

import pytest

from tests.server.conftest import TINY, TINY_ARCHIVE
from tests.server.torchserve.test_inference_api import stream_lines

MAX_RESPONSE = 20_000
MAX_REQUEST = 100_000


@pytest.fixture(scope="module")
def server(inprocess_factory):
    return inprocess_factory(
        load_models=[f"{TINY}={TINY_ARCHIVE}"],
        max_request_size=MAX_REQUEST,
        max_response_size=MAX_RESPONSE,
        job_queue_size=2,
    )


def worker(server) -> dict:
    [desc] = server.get("management", f"/models/{TINY}").json()
    [w] = desc["workers"]
    return w


def server_errors(server) -> list[str]:
    """The 5xx counters of the inference routes on the metrics port."""
    return [
        line
        for line in server.get("metrics", "/metrics").text.splitlines()
        if line.startswith("pagedserve_requests_total") and 'status="5' in line
    ]


BAD_INPUT = [
    # (path, raw body, expected status, words in the message)
    (f"/predictions/{TINY}", b"{not json", 400, ["JSON"]),
    (f"/predictions/{TINY}", b"[1, 2]", 400, ["object"]),
    (f"/predictions/{TINY}", b"\xff\xfe", 400, ["UTF-8"]),
    (f"/predictions/{TINY}", b"", 400, ["JSON"]),
    (f"/predictions/{TINY}", {"prompt": 7}, 400, ["prompt"]),
    (f"/predictions/{TINY}", {"prompt": "x", "temperature": "hot"}, 400, ["temperature"]),
    (f"/predictions/{TINY}", {"prompt": "x", "temperature": -1}, 400, ["temperature"]),
    (f"/predictions/{TINY}", {"prompt": "x", "top_p": 1.5}, 400, ["top_p"]),
    (f"/predictions/{TINY}", {"prompt": "x", "max_tokens": -3}, 400, ["max_tokens"]),
    (f"/predictions/{TINY}", {"prompt": "x", "max_tokens": 4000}, 400, ["max_tokens", "256"]),
    (f"/predictions/{TINY}", {"prompt": "hello " * 300}, 400, ["max_model_len"]),
    (f"/predictions/{TINY}", {"prompt": [1, 2, 10_000_000]}, 400, ["out of range"]),
    (f"/predictions/{TINY}", {"prompt": "x", "n": 0}, 400, ["n"]),
    (f"/predictions/{TINY}", {"prompt": "x", "logprobs": 99}, 400, ["logprobs"]),
    (f"/predictions/{TINY}", {"prompt": "x", "stop": [""]}, 400, ["stop"]),
    (f"/predictions/{TINY}", {"prompt": "x", "frobnicate": 1}, 400, ["frobnicate"]),
    (f"/predictions/{TINY}", {"messages": "hi"}, 400, ["messages"]),
    (
        f"/predictions/{TINY}",
        {"prompt": "x", "max_tokens": 60, "logprobs": 20, "ignore_eos": True},
        413,
        ["max_response_size"],
    ),
    (f"/predictions/{TINY}", {"prompt": "x" * (MAX_REQUEST + 10)}, 413, ["max_request_size"]),
    ("/predictions/nosuchmodel", {"prompt": "x"}, 404, ["nosuchmodel"]),
    (f"/predictions/{TINY}/9.9", {"prompt": "x"}, 404, ["9.9"]),
    ("/v1/completions", {"model": "nosuchmodel", "prompt": "x"}, 404, ["nosuchmodel"]),
    ("/v1/completions", {"model": f"{TINY}@9.9", "prompt": "x"}, 404, ["9.9"]),
    ("/v1/completions", {"prompt": "x"}, 400, ["model"]),
    ("/v1/completions", {"model": TINY, "prompt": "x", "echo": True, "logprobs": 1}, 400, ["echo"]),
    ("/v1/completions", {"model": TINY, "prompt": "x", "max_tokens": "5"}, 400, ["max_tokens"]),
    ("/v1/completions", {"model": TINY, "prompt": "x", "bogus": 1}, 400, ["bogus"]),
    ("/v1/chat/completions", {"model": TINY, "messages": [{"role": "user"}]}, 400, ["content"]),
    (
        "/v1/chat/completions",
        {
            "model": TINY,
            "messages": [{"role": "user", "content": "x"}],
            "tools": [{"type": "function", "function": {"name": "bad name!"}}],
        },
        400,
        ["tools"],
    ),
    (
        "/v1/chat/completions",
        {"model": TINY, "messages": [{"role": "user", "content": "x"}], "max_completion_tokens": 5000},
        400,
        ["max_tokens"],
    ),
]


def test_full_queue_answers_503_with_retry_after(server):
    """jobQueueSize=2: two requests in flight (the worker is stopped, so they stay) fill the
    queue; a third request is turned away at once, without reaching the worker."""
    body = json.dumps({"prompt": "Tell me a story.", "max_tokens": 8, "stream": True})
    headers = {"Authorization": f"Bearer {server.keys['inference']}", "Content-Type": "application/json"}
    [version] = server.state.registry.all_versions()
    pid = worker(server)["pid"]
    os.kill(pid, signal.SIGSTOP)
    streams = []
    try:
        for _ in range(2):
            conn = http.client.HTTPConnection("127.0.0.1", server.ports["inference"], timeout=60)
            conn.request("POST", f"/predictions/{TINY}", body=body, headers=headers)
            streams.append(conn)
        server.wait_for(lambda: version.in_flight == 2, 30, what="two requests in flight")
        r = server.predict(TINY)
        assert r.status == 503 and r.headers["Retry-After"] == "1" and "jobQueueSize=2" in r.json()["message"]
        for conn in streams:  # hanging up aborts both requests and frees the queue
            conn.close()
        server.wait_for(lambda: version.in_flight == 0, 30, what="queue drained")
    finally:
        os.kill(pid, signal.SIGCONT)
    assert server.predict(TINY).status == 200


def test_bad_input_is_refused_with_4xx_and_the_worker_keeps_serving(server):
    before = worker(server)
    errors_before = server_errors(server)
    for path, body, code, words in BAD_INPUT:
        data = body if isinstance(body, bytes) else json.dumps(body).encode()
        r = server.post("inference", path, data=data, headers={"Content-Type": "application/json"})
        assert r.status == code, (path, body if isinstance(body, bytes) else str(body)[:80], r.status, r.text)
        reply = r.json()
        message = reply["error"]["message"] if path.startswith("/v1") else reply["message"]
        assert all(w in message for w in words), (path, message)
        assert r.headers["x-request-id"]
    # A stream whose response grows too large ends with an error event instead.
    status, _, lines = stream_lines(
        server,
        f"/predictions/{TINY}",
        {"prompt": "x", "max_tokens": 60, "logprobs": 20, "ignore_eos": True, "stream": True},
    )
    assert status == 200 and json.loads(lines[-1])["error"]["code"] == 413
    after = worker(server)
    assert after["pid"] == before["pid"] and after["restarts"] == 0 and after["status"] == "READY"
    assert server.predict(TINY).status == 200
    assert server_errors(server) == errors_before


ROUTES = [  # the health probes answer without a token (tests/server/app/test_probes_and_keys.py)
    ("GET", "/v1/models", None),
    ("GET", f"/predictions/{TINY}/1.0/v1/models", None),
    ("POST", f"/predictions/{TINY}", {"prompt": "x", "max_tokens": 1}),
    ("POST", f"/predictions/{TINY}/1.0", {"prompt": "x", "max_tokens": 1}),
    ("POST", "/v1/completions", {"model": TINY, "prompt": "x", "max_tokens": 1}),
    ("POST", "/v1/chat/completions", {"model": TINY, "messages": [{"role": "user", "content": "x"}], "max_tokens": 1}),
    ("POST", f"/predictions/{TINY}/1.0/v1/completions", {"prompt": "x", "max_tokens": 1}),
    (
        "POST",
        f"/predictions/{TINY}/1.0/v1/chat/completions",
        {"messages": [{"role": "user", "content": "x"}], "max_tokens": 1},
    ),
]


@pytest.mark.parametrize("method, path, body", ROUTES, ids=[f"{m} {p}" for m, p, _ in ROUTES])
def test_every_inference_route_needs_the_inference_key(server, method, path, body):
    data = None if body is None else json.dumps(body).encode()
    for token in (None, "wrong-token", server.keys["management"]):
        r = server.request(method, "inference", path, data=data, token=token)
        assert r.status == 401, (token, r.status, r.text)
        reply = r.json()
        code = reply["error"]["code"] if "/v1/" in path else reply["code"]  # shaped by route
        assert code == 401 and r.headers.get("WWW-Authenticate") == "Bearer"
    r = server.request(method, "inference", path, data=data)
    assert r.status == 200, r.text


def test_models_list(server):
    data = server.get("inference", "/v1/models").json()["data"]
    assert [m["id"] for m in data] == [TINY, f"{TINY}@1.0"]
    assert data[0]["object"] == "model" and data[0]["max_model_len"] == 256
    [only] = server.get("inference", f"/predictions/{TINY}/1.0/v1/models").json()["data"]
    assert only["id"] == f"{TINY}@1.0"
