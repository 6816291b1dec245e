"""The metrics port on a real server: request counts by status, latency and engine histograms
fed by real requests, engine gauges read from the workers at scrape time."""

from __future__ import annotations

import pytest
from prometheus_client.parser import text_string_to_metric_families

from pagedserve.server.workers.registry import worker_threads
from tests.server.conftest import MODEL

pytestmark = pytest.mark.slow

LONG_PROMPT = "The quick brown fox jumps over the lazy dog. " * 8  # > 4 full KV blocks


def scrape(server) -> dict[str, list]:
    r = server.get("metrics", "/metrics")
    assert r.status == 200 and r.headers["Content-Type"].startswith("text/plain")
    samples: dict[str, list] = {}
    for family in text_string_to_metric_families(r.text):
        for s in family.samples:
            samples.setdefault(s.name, []).append(s)
    return samples


def value(samples, name, **labels) -> float:
    found = [s.value for s in samples.get(name, []) if all(s.labels.get(k) == v for k, v in labels.items())]
    assert found, (name, labels, sorted(samples))
    return sum(found)


def test_requests_and_engine_figures(server):
    for _ in range(2):  # the second finds the prompt in the prefix cache
        r = server.predict(MODEL, prompt=LONG_PROMPT, max_tokens=6)
        assert r.status == 200, r.text
    assert server.predict("no-such-model").status == 404
    server.wait_for(
        lambda: value(scrape(server), "pagedserve_kv_blocks_used", model=MODEL) == 0,
        timeout=10,
        what="KV blocks released",
    )
    m = scrape(server)
    assert value(m, "pagedserve_requests_total", model=MODEL, status="200") >= 2
    assert value(m, "pagedserve_requests_total", status="404") >= 1
    assert server.get("management", "/models/no-such-model").status == 404
    m = scrape(server)
    assert value(m, "pagedserve_requests_total", endpoint="management", status="404") >= 1
    assert value(m, "pagedserve_request_latency_seconds_count", model=MODEL) >= 2
    for hist in ("time_to_first_token", "queue_time", "time_per_output_token"):
        assert value(m, f"pagedserve_{hist}_seconds_count", model=MODEL) >= 2, hist
    assert value(m, "pagedserve_inter_token_latency_seconds_count", model=MODEL) >= 2 * 5
    assert value(m, "pagedserve_generation_tokens_total", model=MODEL) >= 12
    # Engine gauges, from the worker's latest stats.
    free = value(m, "pagedserve_kv_blocks_free", model=MODEL, version="1.0")
    assert free == 182  # 64 MiB of bf16 KV for SmolLM2-135M, every block free again
    assert value(m, "pagedserve_num_requests_running", model=MODEL) == 0
    assert value(m, "pagedserve_num_requests_waiting", model=MODEL) == 0
    assert value(m, "pagedserve_workers_ready", model=MODEL) == 1
    assert 0 < value(m, "pagedserve_prefix_cache_hit_rate", model=MODEL) < 1
    assert value(m, "pagedserve_preemptions_total", model=MODEL) == 0
    assert value(m, "pagedserve_spec_decode_draft_tokens_total", model=MODEL) == 0  # not configured
    assert value(m, "pagedserve_spec_decode_requests_drafted_total", model=MODEL) == 0
    assert value(m, "pagedserve_spec_decode_suffix_global_bytes", model=MODEL) == 0


def test_worker_threads_share_the_cores(server, monkeypatch):
    [desc] = server.get("management", f"/models/{MODEL}").json()
    assert [w["threads"] for w in desc["workers"]] == [1]  # PAGEDSERVE_WORKER_THREADS=1 in tests
    monkeypatch.setattr("os.cpu_count", lambda: 8)
    assert [worker_threads(None, n) for n in (1, 2, 3, 8, 20)] == [8, 4, 2, 1, 1]
    assert worker_threads(3, 8) == 3
