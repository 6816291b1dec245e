"""Prefix-cache miss causes on the real server: each reply's `timings.prefix_cache_miss` and the
metrics port's `pagedserve_prefix_cache_misses_total` / `..._missed_tokens_total` by cause
(every cause is provoked on the engine in tests/engine/kv_cache/test_miss_causes.py)."""

from __future__ import annotations

import pytest

from tests.server.conftest import MODEL
from tests.server.metrics.test_metrics import scrape

pytestmark = pytest.mark.slow

# This module's own prompt (> 3 full KV blocks): nothing else on the shared server sends it.
PROMPT = "Prefix miss causes, a test of their own: " + "the river bends, the hills fold, the sky turns. " * 6
CAUSES = ("first_seen", "salt_differs")


def _counts(server) -> dict[tuple[str, str], float]:
    """(family sample, cause) -> value, for this module's model."""
    samples = scrape(server)
    return {
        (name, cause): sum(
            s.value for s in samples.get(name, []) if s.labels.get("model") == MODEL and s.labels.get("cause") == cause
        )
        for name in ("pagedserve_prefix_cache_misses_total", "pagedserve_prefix_cache_missed_tokens_total")
        for cause in CAUSES
    }


def _complete(server, **extra) -> dict | None:
    body = {"model": MODEL, "prompt": PROMPT, "max_tokens": 1, "temperature": 0, **extra}
    r = server.post("inference", "/v1/completions", json=body)
    assert r.status == 200, r.text
    return r.json()["timings"]["prefix_cache_miss"]


def test_miss_causes_in_timings_and_metrics(server):
    before = _counts(server)
    first = _complete(server)
    assert first["cause"] == "first_seen" and first["tokens"] >= 48 and first["tokens"] % 16 == 0
    assert _complete(server) is None  # every full block reused
    assert _complete(server, cache_salt="tenant-b") == {"cause": "salt_differs", "tokens": first["tokens"]}
    r = server.predict(MODEL, prompt=PROMPT, max_tokens=1)  # /predictions carries the same record
    assert r.status == 200 and r.json()["timings"]["prefix_cache_miss"] is None

    after = _counts(server)
    for cause in CAUSES:  # other modules' requests may add to first_seen meanwhile, never subtract
        assert (
            after["pagedserve_prefix_cache_misses_total", cause]
            >= before["pagedserve_prefix_cache_misses_total", cause] + 1
        )
        assert (
            after["pagedserve_prefix_cache_missed_tokens_total", cause]
            >= before["pagedserve_prefix_cache_missed_tokens_total", cause] + first["tokens"]
        )
