"""The inference port over a real `pagedserve serve`, the real model and real HTTP: /predictions
answered whole and as chunked NDJSON, timings and request ids, chat, stop strings and `n`, the
prefix cache seen in the timings. Routes, auth, status codes and error shapes are tested
in-process (test_inference_routes.py)."""

from __future__ import annotations

import http.client
import json

import pytest

from tests.server.conftest import MODEL

pytestmark = pytest.mark.slow

PROMPT = "1, 2, 3, 4,"


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
    status, headers, lines = stream_lines(
        server, f"/predictions/{MODEL}", {"prompt": PROMPT, "max_tokens": 10, "temperature": 0, "stream": True}
    )
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
    r = server.post(
        "inference",
        f"/predictions/{MODEL}",
        json={"messages": [{"role": "user", "content": "What is 2 plus 2?"}], "max_tokens": 30, "temperature": 0},
    )
    assert r.status == 200 and "4" in r.json()["choices"][0]["text"]
    r = server.post(
        "inference",
        f"/predictions/{MODEL}",
        json={"prompt": PROMPT, "max_tokens": 12, "temperature": 0, "stop": [" 7"]},
    )
    [choice] = r.json()["choices"]
    assert choice["text"] == " 5, 6," and choice["finish_reason"] == "stop" and choice["stop_reason"] == " 7"
    r = server.post("inference", f"/predictions/{MODEL}", json={"prompt": PROMPT, "max_tokens": 4, "n": 3, "seed": 1})
    assert [c["index"] for c in r.json()["choices"]] == [0, 1, 2]


def test_prefix_cache_shows_in_timings(server):
    # > 4 blocks of 16 tokens, opening with words of this test's own: the server is shared by
    # other modules (tests/server/conftest.py), whose prompts must not have cached its first blocks.
    prompt = "Timings of the prefix cache. " + "The quick brown fox jumps over the lazy dog. " * 6
    first = server.predict(MODEL, prompt=prompt, max_tokens=2).json()
    second = server.predict(MODEL, prompt=prompt, max_tokens=2).json()
    assert second["timings"]["cached_prompt_tokens"] >= 48
    assert second["usage"]["cached_prompt_tokens"] == second["timings"]["cached_prompt_tokens"]
    assert first["timings"]["cached_prompt_tokens"] < second["timings"]["cached_prompt_tokens"]
