"""The inference port over a real `pagedserve serve` and real HTTP: /predictions answered whole
and as chunked NDJSON, timings and request ids, the prefix cache seen in the timings, bad input
(4xx naming the problem, never a 5xx, and the worker keeps serving), size limits, and token
authorization on every inference route."""

from __future__ import annotations

import http.client
import json

import pytest

from tests.server.conftest import ARCHIVE, MODEL

pytestmark = pytest.mark.slow

MAX_RESPONSE = 20_000
MAX_REQUEST = 100_000
PROMPT = "1, 2, 3, 4,"


@pytest.fixture(scope="module")
def server(module_server_factory):
    return module_server_factory(models=[f"{MODEL}={ARCHIVE}"],
                                 config={"max_request_size": MAX_REQUEST, "max_response_size": MAX_RESPONSE,
                                         "job_queue_size": 2})


def worker(server) -> dict:
    [desc] = server.get("management", f"/models/{MODEL}").json()
    [w] = desc["workers"]
    return w


def server_errors(server) -> list[str]:
    """The 5xx counters of the inference routes on the metrics port."""
    return [line for line in server.get("metrics", "/metrics").text.splitlines()
            if line.startswith("pagedserve_requests_total") and 'status="5' in line
            and 'endpoint="ready"' not in line]  # /ready answered 503 while the worker started


def stream_lines(server, path: str, body: dict, token: str | None = "default") -> tuple[int, dict, list[bytes]]:
    """POST and read the reply chunk by chunk, as a streaming client does."""
    conn = http.client.HTTPConnection("127.0.0.1", server.ports["inference"], timeout=120)
    key = server.keys["inference"] if token == "default" else token
    headers = {"Content-Type": "application/json", **({"Authorization": f"Bearer {key}"} if key else {})}
    conn.request("POST", path, body=json.dumps(body), headers=headers)
    resp = conn.getresponse()
    lines = [line for line in resp.read().split(b"\n") if line]
    conn.close()
    return resp.status, {k.lower(): v for k, v in resp.getheaders()}, lines


def test_predictions_whole_reply(server):
    r = server.predict(MODEL, prompt=PROMPT, max_tokens=8)
    assert r.status == 200, r.text
    body = r.json()
    [choice] = body["choices"]
    assert choice["text"].startswith(" 5, 6, 7") and choice["finish_reason"] == "length"
    assert len(choice["token_ids"]) == 8
    assert body["usage"]["completion_tokens"] == 8 and body["usage"]["prompt_tokens"] == 11
    timings = body["timings"]
    assert set(timings) >= {"queued_s", "prefill_s", "decode_s", "ttft_s", "cached_prompt_tokens", "total_s"}
    assert 0 < timings["ttft_s"] <= timings["total_s"] and timings["decode_s"] > 0
    assert r.headers["x-request-id"] == body["id"]
    again = server.predict(MODEL, version="1.0", prompt=PROMPT, max_tokens=8)
    assert again.status == 200 and again.json()["choices"][0]["text"] == choice["text"]  # greedy, same version
    assert again.headers["x-request-id"] != r.headers["x-request-id"]


def test_predictions_chunked_stream(server):
    whole = server.predict(MODEL, prompt=PROMPT, max_tokens=10).json()
    status, headers, lines = stream_lines(server, f"/predictions/{MODEL}",
                                          {"prompt": PROMPT, "max_tokens": 10, "temperature": 0, "stream": True})
    assert status == 200 and headers["transfer-encoding"] == "chunked"
    assert headers["content-type"].startswith("application/x-ndjson") and headers["x-request-id"]
    chunks = [json.loads(line) for line in lines]
    assert len(chunks) > 1  # token by token, not one blob
    text = "".join(c["choices"][0]["text"] for c in chunks if c["choices"])
    ids = [t for c in chunks for t in (c["choices"][0]["token_ids"] if c["choices"] else [])]
    assert text == whole["choices"][0]["text"] and ids == whole["choices"][0]["token_ids"]
    assert all("timings" not in c for c in chunks[:-1])
    last = chunks[-1]
    assert last["choices"][0]["finish_reason"] == "length" and last["usage"]["completion_tokens"] == 10
    assert last["timings"]["ttft_s"] > 0 and all(c["id"] == headers["x-request-id"] for c in chunks)


def test_chat_messages_stop_and_n(server):
    r = server.post("inference", f"/predictions/{MODEL}", json={
        "messages": [{"role": "user", "content": "What is 2 plus 2?"}], "max_tokens": 30, "temperature": 0})
    assert r.status == 200 and "4" in r.json()["choices"][0]["text"]
    r = server.post("inference", f"/predictions/{MODEL}", json={
        "prompt": PROMPT, "max_tokens": 12, "temperature": 0, "stop": [" 7"]})
    [choice] = r.json()["choices"]
    assert choice["text"] == " 5, 6," and choice["finish_reason"] == "stop" and choice["stop_reason"] == " 7"
    r = server.post("inference", f"/predictions/{MODEL}", json={"prompt": PROMPT, "max_tokens": 4, "n": 3, "seed": 1})
    assert [c["index"] for c in r.json()["choices"]] == [0, 1, 2]


def test_prefix_cache_shows_in_timings(server):
    prompt = "The quick brown fox jumps over the lazy dog. " * 6  # > 4 blocks of 16 tokens
    first = server.predict(MODEL, prompt=prompt, max_tokens=2).json()
    second = server.predict(MODEL, prompt=prompt, max_tokens=2).json()
    assert second["timings"]["cached_prompt_tokens"] >= 48
    assert second["usage"]["cached_prompt_tokens"] == second["timings"]["cached_prompt_tokens"]
    assert first["timings"]["cached_prompt_tokens"] < second["timings"]["cached_prompt_tokens"]


BAD_INPUT = [
    # (path, raw body, expected status, words in the message)
    (f"/predictions/{MODEL}", b"{not json", 400, ["JSON"]),
    (f"/predictions/{MODEL}", b"[1, 2]", 400, ["object"]),
    (f"/predictions/{MODEL}", b"\xff\xfe", 400, ["UTF-8"]),
    (f"/predictions/{MODEL}", b"", 400, ["JSON"]),
    (f"/predictions/{MODEL}", {"prompt": 7}, 400, ["prompt"]),
    (f"/predictions/{MODEL}", {"prompt": "x", "temperature": "hot"}, 400, ["temperature"]),
    (f"/predictions/{MODEL}", {"prompt": "x", "temperature": -1}, 400, ["temperature"]),
    (f"/predictions/{MODEL}", {"prompt": "x", "top_p": 1.5}, 400, ["top_p"]),
    (f"/predictions/{MODEL}", {"prompt": "x", "max_tokens": -3}, 400, ["max_tokens"]),
    (f"/predictions/{MODEL}", {"prompt": "x", "max_tokens": 4000}, 400, ["max_tokens", "2048"]),
    (f"/predictions/{MODEL}", {"prompt": "hello " * 2100}, 400, ["max_model_len"]),
    (f"/predictions/{MODEL}", {"prompt": [1, 2, 10_000_000]}, 400, ["out of range"]),
    (f"/predictions/{MODEL}", {"prompt": "x", "n": 0}, 400, ["n"]),
    (f"/predictions/{MODEL}", {"prompt": "x", "logprobs": 99}, 400, ["logprobs"]),
    (f"/predictions/{MODEL}", {"prompt": "x", "stop": [""]}, 400, ["stop"]),
    (f"/predictions/{MODEL}", {"prompt": "x", "frobnicate": 1}, 400, ["frobnicate"]),
    (f"/predictions/{MODEL}", {"messages": "hi"}, 400, ["messages"]),
    (f"/predictions/{MODEL}", {"prompt": "x", "max_tokens": 60, "logprobs": 20, "ignore_eos": True}, 413,
     ["max_response_size"]),
    (f"/predictions/{MODEL}", {"prompt": "x" * (MAX_REQUEST + 10)}, 413, ["max_request_size"]),
    ("/predictions/nosuchmodel", {"prompt": "x"}, 404, ["nosuchmodel"]),
    (f"/predictions/{MODEL}/9.9", {"prompt": "x"}, 404, ["9.9"]),
    ("/v1/completions", {"model": "nosuchmodel", "prompt": "x"}, 404, ["nosuchmodel"]),
    ("/v1/completions", {"model": f"{MODEL}@9.9", "prompt": "x"}, 404, ["9.9"]),
    ("/v1/completions", {"prompt": "x"}, 400, ["model"]),
    ("/v1/completions", {"model": MODEL, "prompt": "x", "echo": True, "logprobs": 1}, 400, ["echo"]),
    ("/v1/completions", {"model": MODEL, "prompt": "x", "max_tokens": "5"}, 400, ["max_tokens"]),
    ("/v1/completions", {"model": MODEL, "prompt": "x", "bogus": 1}, 400, ["bogus"]),
    ("/v1/chat/completions", {"model": MODEL, "messages": [{"role": "user"}]}, 400, ["content"]),
    ("/v1/chat/completions", {"model": MODEL, "messages": [{"role": "user", "content": "x"}],
                              "tools": [{"type": "function", "function": {"name": "bad name!"}}]}, 400, ["tools"]),
    ("/v1/chat/completions", {"model": MODEL, "messages": [{"role": "user", "content": "x"}],
                              "max_completion_tokens": 5000}, 400, ["max_tokens"]),
]


def test_full_queue_answers_503_with_retry_after(server):
    """jobQueueSize=2: two open streams fill the queue; a third request is turned away at once."""
    body = json.dumps({"prompt": "Tell me a story.", "max_tokens": 300, "ignore_eos": True, "stream": True})
    headers = {"Authorization": f"Bearer {server.keys['inference']}", "Content-Type": "application/json"}
    streams = []
    for _ in range(2):
        conn = http.client.HTTPConnection("127.0.0.1", server.ports["inference"], timeout=60)
        conn.request("POST", f"/predictions/{MODEL}", body=body, headers=headers)
        assert conn.getresponse().status == 200  # headers arrive with the first token
        streams.append(conn)
    r = server.predict(MODEL)
    assert r.status == 503 and r.headers["Retry-After"] == "1" and "jobQueueSize=2" in r.json()["message"]
    for conn in streams:  # hanging up aborts both requests and frees the queue
        conn.close()
    server.wait_for(lambda: server.predict(MODEL).status == 200, timeout=30, what="queue drained")


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
    status, _, lines = stream_lines(server, f"/predictions/{MODEL}",
                                    {"prompt": "x", "max_tokens": 60, "logprobs": 20, "ignore_eos": True,
                                     "stream": True})
    assert status == 200 and json.loads(lines[-1])["error"]["code"] == 413
    after = worker(server)
    assert after["pid"] == before["pid"] and after["restarts"] == 0 and after["status"] == "READY"
    assert server.predict(MODEL).status == 200
    assert server_errors(server) == errors_before


ROUTES = [
    ("GET", "/ping", None),
    ("GET", "/live", None),
    ("GET", "/ready", None),
    ("GET", "/v1/models", None),
    ("GET", f"/predictions/{MODEL}/1.0/v1/models", None),
    ("POST", f"/predictions/{MODEL}", {"prompt": "x", "max_tokens": 1}),
    ("POST", f"/predictions/{MODEL}/1.0", {"prompt": "x", "max_tokens": 1}),
    ("POST", "/v1/completions", {"model": MODEL, "prompt": "x", "max_tokens": 1}),
    ("POST", "/v1/chat/completions", {"model": MODEL, "messages": [{"role": "user", "content": "x"}], "max_tokens": 1}),
    ("POST", f"/predictions/{MODEL}/1.0/v1/completions", {"prompt": "x", "max_tokens": 1}),
    ("POST", f"/predictions/{MODEL}/1.0/v1/chat/completions",
     {"messages": [{"role": "user", "content": "x"}], "max_tokens": 1}),
]


@pytest.mark.parametrize("method, path, body", ROUTES, ids=[f"{m} {p}" for m, p, _ in ROUTES])
def test_every_inference_route_needs_the_inference_key(server, method, path, body):
    data = None if body is None else json.dumps(body).encode()
    for token in (None, "wrong-token", server.keys["management"]):
        r = server.request(method, "inference", path, data=data, token=token)
        assert r.status == 401, (token, r.status, r.text)
        assert r.json()["code"] == 401 and r.headers.get("WWW-Authenticate") == "Bearer"
    r = server.request(method, "inference", path, data=data)
    assert r.status == 200, r.text


def test_models_list(server):
    data = server.get("inference", "/v1/models").json()["data"]
    assert [m["id"] for m in data] == [MODEL, f"{MODEL}@1.0"]
    assert data[0]["object"] == "model" and data[0]["max_model_len"] == 2048
    [only] = server.get("inference", f"/predictions/{MODEL}/1.0/v1/models").json()["data"]
    assert only["id"] == f"{MODEL}@1.0"
