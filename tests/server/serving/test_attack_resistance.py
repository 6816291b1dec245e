"""Issue 11's availability attacks against a real `pagedserve serve` with the default model:
deeply nested JSON schemas (finding 1), streams with many long stop strings (finding 2) and
huge prompts that are refused (finding 4). Each asserts behaviour (status codes, messages,
the streamed text, the front end's resident memory), never how long something took.
"""

from __future__ import annotations

import concurrent.futures
import http.client
import json

import pytest

from pagedserve.engine.structured_output.limits import MAX_SCHEMA_DEPTH
from tests.server.conftest import MODEL

pytestmark = pytest.mark.slow

PROMPT = "1, 2, 3, 4,"
HUGE_PROMPT_CHARS = 6_000_000  # the 6 MB prompt (under max_request_size, 6,553,500 bytes)
RSS_SLACK_MB = 100


def nested_array_schema(depth: int) -> dict:
    schema: dict = {"type": "integer"}
    for _ in range(depth):
        schema = {"type": "array", "items": schema}
    return schema


def rss_mb(pid: int) -> float:
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024
    raise RuntimeError("no VmRSS")


def test_deep_schemas_are_refused_naming_the_limit_and_plain_requests_pass(server):
    """Four 700-deep schemas (each held a tokenization thread for minutes) and a plain request
    at once: the schemas get 400 naming the depth limit, the plain request its answer."""
    # As JSON text: the body's own nesting bound (64) does not see inside a string.
    attack = {"prompt": PROMPT, "max_tokens": 4, "structured_outputs": {"json": json.dumps(nested_array_schema(700))}}
    chat_attack = {
        "model": MODEL,
        "messages": [{"role": "user", "content": "hi"}],
        "max_tokens": 4,
        "guided_json": json.dumps(nested_array_schema(700)),
    }
    with concurrent.futures.ThreadPoolExecutor(6) as pool:
        attacks = [pool.submit(server.post, "inference", f"/predictions/{MODEL}", json=attack) for _ in range(3)]
        attacks.append(pool.submit(server.post, "inference", "/v1/chat/completions", json=chat_attack))
        plain = pool.submit(server.predict, MODEL, prompt=PROMPT, max_tokens=4)
        assert plain.result().status == 200, plain.result().text
        for a in attacks:
            r = a.result()
            assert r.status == 400, r.text
            assert f"at most {MAX_SCHEMA_DEPTH} are allowed" in r.text
    ok = {"prompt": PROMPT, "max_tokens": 16, "temperature": 0, "structured_outputs": {"json": nested_array_schema(3)}}
    r = server.post("inference", f"/predictions/{MODEL}", json=ok)
    assert r.status == 200, r.text
    json.loads(r.json()["choices"][0]["text"])  # still constrained: a valid nested array


def stream_text(server, body: dict) -> tuple[str, dict]:
    """The NDJSON stream's text deltas joined, and its last line."""
    conn = http.client.HTTPConnection("127.0.0.1", server.ports["inference"], timeout=300)
    conn.request(
        "POST",
        f"/predictions/{MODEL}",
        body=json.dumps({**body, "stream": True}),
        headers={"Authorization": f"Bearer {server.keys['inference']}", "Content-Type": "application/json"},
    )
    resp = conn.getresponse()
    assert resp.status == 200
    lines = [json.loads(line) for line in resp.read().split(b"\n") if line]
    conn.close()
    return "".join(c["text"] for line in lines for c in line.get("choices", [])), lines[-1]


def test_many_long_stop_strings_stream_the_same_text(server):
    """64 stop strings of 1,024 characters that keep matching the output's tail (so the stream
    holds text back at every chunk), and one real stop string: the stream's deltas join to the
    whole reply's text, cut before the stop string."""
    junk = [f" {i}, {i + 1}, {i + 2}," + "q" * 1010 for i in range(5, 68)]
    stop = [*junk, " 9,"]
    body = {"prompt": PROMPT, "max_tokens": 24, "temperature": 0, "stop": stop}
    whole = server.post("inference", f"/predictions/{MODEL}", json=body)
    assert whole.status == 200, whole.text
    [choice] = whole.json()["choices"]
    assert choice["text"] == " 5, 6, 7, 8," and choice["stop_reason"] == " 9,"
    text, last = stream_text(server, body)
    assert text == choice["text"] and last["choices"][0]["finish_reason"] == "stop"


def test_rss_after_rejected_huge_prompts(server):
    """20 prompts of 6 MB (four at a time, so every front-end thread sees some) are refused as
    too long without being tokenized, and the front end's memory stays where it started
    (it used to keep ~800 MB per thread that had tokenized one)."""
    pid = server.proc.pid
    assert server.predict(MODEL, prompt=PROMPT, max_tokens=2).status == 200
    before = rss_mb(pid)
    body = {"prompt": "1, 2, 3, 4, " * (HUGE_PROMPT_CHARS // 12), "max_tokens": 4}
    with concurrent.futures.ThreadPoolExecutor(4) as pool:
        replies = list(pool.map(lambda _: server.post("inference", f"/predictions/{MODEL}", json=body), range(20)))
    for r in replies:
        assert r.status == 400, r.text
        assert "'prompt' has 6000000 characters" in r.text
    after = rss_mb(pid)
    assert after - before < RSS_SLACK_MB, f"front-end RSS {before:.0f} MB -> {after:.0f} MB"
    assert server.predict(MODEL, prompt=PROMPT, max_tokens=2).status == 200
