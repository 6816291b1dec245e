"""Disaggregated prefill and decode (pagedserve.server.workers.disagg), in-process on the tiny
random-weight model in float32, with real worker processes sharing an LMCache disk folder: a
version registered with worker_roles=prefill,decode hands each long prompt's KV from its
prefill worker to its decode worker, with outputs identical to a single `both` worker (whole
and streamed); short prompts stay local; the metrics and response timings show the path, the
bytes moved and the TTFT phases; a prefill worker killed with SIGKILL mid-run loses no request
(they fall back to the decode worker's own prefill); bad roles are refused naming the field.
"""

from __future__ import annotations

import json
import os
import re
import signal
import threading
import time
import urllib.request

import pytest

from tests.server.conftest import TINY_ARCHIVE, TINY_ARCHIVE_V2

CHUNK = 32
MODEL = "pd"
REF = "ref"
MAX_TOKENS = 12


def _prompt(i: int, n_words: int = 60) -> list[int]:
    """A token-id prompt of ~n_words*2 tokens, different per i (ids from the tokenizer's range)."""
    return [1000 + (i * 131 + k * 17) % 20000 for k in range(2 * n_words)]


@pytest.fixture(scope="module")
def server(inprocess_factory, tmp_path_factory):
    folder = tmp_path_factory.mktemp("pd-kv")
    s = inprocess_factory(
        enable_model_api=True,
        kv_offload={"disk_path": str(folder), "disk_size_gb": 0.5, "cpu_size_gb": 0.05, "chunk_size": CHUNK},
    )
    r = s.post(
        "management",
        f"/models?url={TINY_ARCHIVE}&model_name={MODEL}&initial_workers=2&synchronous=true&worker_roles=prefill,decode",
    )
    assert r.status == 200, r.text
    r = s.post("management", f"/models?url={TINY_ARCHIVE_V2}&model_name={REF}&initial_workers=1&synchronous=true")
    assert r.status == 200, r.text
    return s


def complete(server, model: str, prompt: list[int], stream: bool = False, max_tokens: int = MAX_TOKENS):
    body = {"model": model, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0, "stream": stream}
    r = server.post("inference", "/v1/completions", json=body)
    assert r.status == 200, r.text
    if not stream:
        return r.json()
    events = [json.loads(line[6:]) for line in r.text.splitlines() if line.startswith("data: {")]
    return events


def token_ids(server, model: str, prompt: list[int]) -> tuple[list[int], dict]:
    """Greedy token ids through /predictions (which returns ids) and the reply's timings."""
    r = server.post(
        "inference",
        f"/predictions/{model}",
        json={"prompt": prompt, "max_tokens": MAX_TOKENS, "temperature": 0, "ignore_eos": True},
    )
    assert r.status == 200, r.text
    body = r.json()
    return body["choices"][0]["token_ids"], body["timings"]


def workers(server, model: str) -> list[dict]:
    [desc] = server.get("management", f"/models/{model}").json()
    return desc["workers"]


def metric(server, name: str, **labels) -> float:
    text = server.get("metrics", "/metrics").text
    total = 0.0
    for line in text.splitlines():
        if not line.startswith(name + "{") and not line.startswith(name + " "):
            continue
        if all(f'{k}="{v}"' in line for k, v in labels.items()):
            total += float(line.rsplit(" ", 1)[1])
    return total


def test_long_prompts_are_handed_off_with_the_same_tokens(server):
    for i in range(3):
        prompt = _prompt(i)
        got, timings = token_ids(server, MODEL, prompt)
        want, _ = token_ids(server, REF, prompt)
        assert got == want
        d = timings["disagg"]
        assert d["path"] == "disaggregated" and d["reason"] is None, d
        assert d["prefill_worker"] != d["decode_worker"]
        # All of the prompt but its last partial block came through the connector.
        assert timings["offloaded_prompt_tokens"] == (len(prompt) - 1) // 16 * 16
        assert d["transfer_bytes"] > 0 and d["transfer_s"] > 0 and d["prefill_s"] >= 0
        phases = d["queue_s"] + d["prefill_s"] + d["transfer_s"] + d["first_decode_s"]
        assert phases == pytest.approx(timings["ttft_s"], abs=0.01)


def test_streamed_reply_is_the_same(server):
    prompt = _prompt(7)
    whole = complete(server, REF, prompt)["choices"][0]["text"]
    events = complete(server, MODEL, prompt, stream=True)
    assert "".join(e["choices"][0]["text"] for e in events if e["choices"]) == whole
    assert len([e for e in events if e["choices"] and e["choices"][0]["text"]]) > 1


def test_short_prompts_stay_on_the_decode_worker(server):
    _, timings = token_ids(server, MODEL, _prompt(3, n_words=8))
    assert timings["disagg"]["path"] == "local" and timings["disagg"]["reason"] == "short_prompt"
    assert timings["offloaded_prompt_tokens"] == 0


def test_metrics_show_paths_bytes_and_phases(server):
    token_ids(server, MODEL, _prompt(11))
    assert metric(server, "pagedserve_disagg_requests_total", model=MODEL, path="disaggregated") >= 1
    assert metric(server, "pagedserve_disagg_transfer_bytes_total", model=MODEL) > 0
    for phase in ("queue", "prefill", "transfer", "first_decode"):
        assert metric(server, "pagedserve_disagg_ttft_phase_seconds_count", model=MODEL, phase=phase) >= 1
    assert metric(server, "pagedserve_disagg_transfer_seconds_count", model=MODEL) >= 1
    assert 'pagedserve_disagg_fallback_ratio{model="pd"}' in server.get("metrics", "/metrics").text


def test_kill_9_of_the_prefill_worker_loses_no_request(server):
    prompts = [_prompt(100 + i, n_words=90) for i in range(24)]
    want = [token_ids(server, REF, p)[0] for p in prompts]
    [prefill] = [w for w in workers(server, MODEL) if w["role"] == "prefill"]
    results: dict[int, tuple[int, dict]] = {}

    def send(i: int) -> None:
        body = json.dumps({"prompt": prompts[i], "max_tokens": MAX_TOKENS, "temperature": 0, "ignore_eos": True})
        req = urllib.request.Request(
            server.url("inference", f"/predictions/{MODEL}"),
            data=body.encode(),
            headers={"Content-Type": "application/json", **server.auth_headers("inference")},
        )
        try:
            with urllib.request.urlopen(req, timeout=300) as r:
                results[i] = (r.status, json.loads(r.read()))
        except urllib.error.HTTPError as exc:
            results[i] = (exc.code, {"error": exc.read().decode()})

    before = metric(server, "pagedserve_disagg_requests_total", model=MODEL, path="fallback")
    engine = _prefill_engine(server)
    threads = [threading.Thread(target=send, args=(i,)) for i in range(len(prompts))]
    for t in threads:
        t.start()
    # Kill it while it holds requests (they are queued on it: one prefill at a time).
    deadline = time.monotonic() + 120
    while engine.num_unfinished == 0:
        assert time.monotonic() < deadline, "the prefill worker never got a request"
        time.sleep(0.001)
    os.kill(prefill["pid"], signal.SIGKILL)
    for t in threads:
        t.join(300)
    assert sorted(results) == list(range(len(prompts)))
    for i, (status, body) in results.items():
        assert status == 200, body
        assert body["choices"][0]["token_ids"] == want[i]
    paths = [body["timings"]["disagg"] for _, body in results.values()]
    fell_back = [d for d in paths if d["path"] == "fallback"]
    assert fell_back and {d["reason"] for d in fell_back} <= {"prefill_failed", "prefill_unavailable"}
    assert metric(server, "pagedserve_disagg_requests_total", model=MODEL, path="fallback") >= before + len(fell_back)
    ratio = metric(server, "pagedserve_disagg_fallback_ratio", model=MODEL)
    assert 0 < ratio <= 1
    # The prefill worker comes back and hands off again.
    server.wait_for(
        lambda: all(w["status"] == "READY" for w in workers(server, MODEL)), timeout=120, what="prefill restarted"
    )
    _, timings = token_ids(server, MODEL, _prompt(500))
    assert timings["disagg"]["path"] == "disaggregated"


def _prefill_engine(server):
    version = server.state.registry.resolve(MODEL)
    [slot] = [s for s in version.pool.slots if s.index == 0]
    return slot.engine


@pytest.mark.parametrize(
    ("roles", "message"),
    [
        ("prefill", "worker_roles: must list a decode or both worker beside the prefill ones"),
        ("prefill,decoder", "worker_roles: must be a comma-separated list of prefill, decode, both, got 'decoder'"),
    ],
)
def test_bad_roles_are_refused_naming_the_field(server, roles, message):
    r = server.post("management", f"/models?url={TINY_ARCHIVE}&model_name=bad&worker_roles={roles}")
    assert r.status == 400, r.text
    assert message in r.json()["message"]


def test_roles_need_the_kv_connector(inprocess_factory):
    s = inprocess_factory(enable_model_api=True)
    r = s.post("management", f"/models?url={TINY_ARCHIVE}&model_name=nokv&worker_roles=prefill,decode")
    assert r.status == 400, r.text
    assert re.match(r"workerRoles: prefill workers hand the prompt's KV", r.json()["message"])
