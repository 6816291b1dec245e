"""vLLM's metric names on the metrics port (`vllm_metrics` on), parsed with prometheus_client's
text parser: present with the `model_name` label, moving after real requests on the tiny model;
the Grafana dashboard queries only names the server exposes; `name[]` filtering."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest
from prometheus_client.parser import text_string_to_metric_families

from pagedserve.server.cli import build_parser
from pagedserve.server.common.config import load_server_config
from pagedserve.server.metrics.families import ServerMetrics
from tests.server.conftest import TINY, TINY_ARCHIVE

DASHBOARD = Path(__file__).resolve().parents[3] / "config" / "grafana" / "pagedserve-vllm.json"
PROMPT = "The quick brown fox jumps over the lazy dog. " * 4  # > 2 full KV blocks


@pytest.fixture(scope="module")
def vllm_server(inprocess_factory):
    return inprocess_factory(load_models=[f"{TINY}={TINY_ARCHIVE}"], vllm_metrics=True)


def scrape(server, query: str = "") -> dict[str, dict]:
    """{family name: {sample name: [samples]}} of one scrape."""
    r = server.get("metrics", "/metrics" + query)
    assert r.status == 200, r.text
    out: dict[str, dict] = {}
    for family in text_string_to_metric_families(r.text):
        samples = out.setdefault(family.name, {})
        for s in family.samples:
            samples.setdefault(s.name, []).append(s)
    return out


def value(families, sample: str, default: float | None = None, **labels) -> float:
    for fam in families.values():
        found = [s.value for s in fam.get(sample, []) if all(s.labels.get(k) == v for k, v in labels.items())]
        if found:
            return sum(found)
    if default is not None:
        return default
    raise AssertionError(f"no {sample} {labels} in {sorted(families)}")


def complete(server, max_tokens: int, prompt: str = PROMPT) -> dict:
    r = server.post(
        "inference",
        "/v1/completions",
        json={"model": TINY, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0, "ignore_eos": True},
    )
    assert r.status == 200, r.text
    return r.json()


def test_vllm_names_move_after_requests(vllm_server):
    # Idle first (the workers push their stats about once a second).
    vllm_server.wait_for(
        lambda: value(scrape(vllm_server), "vllm:kv_cache_usage_perc", model_name=TINY) == 0,
        timeout=30,
        what="KV cache idle",
    )
    before = scrape(vllm_server)
    for name in (
        "vllm:num_requests_running",
        "vllm:num_requests_waiting",
        "vllm:kv_cache_usage_perc",
        "vllm:prefix_cache_queries",
        "vllm:prefix_cache_hits",
    ):
        assert before[name], name  # the engine families, present before any request
    queries0 = value(before, "vllm:prefix_cache_queries_total", model_name=TINY)
    hits0 = value(before, "vllm:prefix_cache_hits_total", model_name=TINY)

    first, second = complete(vllm_server, 5), complete(vllm_server, 5)  # the second hits the cache
    prompt_tokens = first["usage"]["prompt_tokens"]
    assert second["usage"]["completion_tokens"] == 5
    # The workers push their stats about once a second: wait until the cache counters moved.
    vllm_server.wait_for(
        lambda: value(scrape(vllm_server), "vllm:prefix_cache_hits_total", model_name=TINY) > hits0,
        timeout=30,
        what="cache hits",
    )
    after = scrape(vllm_server)
    v = lambda name, **kw: value(after, name, model_name=TINY, **kw)  # noqa: E731

    def moved(name: str, **kw) -> float:  # what these two requests added (any test order)
        return v(name, **kw) - value(before, name, default=0.0, model_name=TINY, **kw)

    assert moved("vllm:request_success_total", finished_reason="length") == 2
    assert moved("vllm:e2e_request_latency_seconds_count") == 2
    assert moved("vllm:e2e_request_latency_seconds_sum") > 0
    assert moved("vllm:time_to_first_token_seconds_count") == 2
    assert moved("vllm:inter_token_latency_seconds_count") == 2 * 4
    assert moved("vllm:time_per_output_token_seconds_count") == 2 * 4
    assert moved("vllm:request_time_per_output_token_seconds_count") == 2
    for phase in ("queue", "prefill", "decode", "inference"):
        assert moved(f"vllm:request_{phase}_time_seconds_count") == 2, phase
    assert moved("vllm:prompt_tokens_total") == 2 * prompt_tokens
    assert moved("vllm:generation_tokens_total") == 10
    assert moved("vllm:request_prompt_tokens_sum") == 2 * prompt_tokens
    assert moved("vllm:request_generation_tokens_bucket", le="5.0") == 2
    assert moved("vllm:request_generation_tokens_bucket", le="2.0") == 0
    assert v("vllm:prefix_cache_queries_total") >= queries0 + 2 * prompt_tokens
    hits = v("vllm:prefix_cache_hits_total") - hits0
    assert 16 <= hits < prompt_tokens  # the second found its full blocks, not the last token
    assert 0 <= v("vllm:kv_cache_usage_perc") <= 1
    assert v("vllm:gpu_cache_usage_perc") == v("vllm:kv_cache_usage_perc")
    assert moved("vllm:num_preemptions_total") == 0
    # Today's names are kept beside them.
    assert value(after, "pagedserve_requests_total", model=TINY, status="200") >= 2
    assert value(after, "pagedserve_generation_tokens_total", model=TINY) >= 10


def test_grafana_dashboard_queries_exposed_names(vllm_server):
    complete(vllm_server, 2, prompt="Grafana " + PROMPT)  # every histogram has a sample
    exposed = {s for fam in scrape(vllm_server).values() for s in fam}
    dashboard = json.loads(DASHBOARD.read_text())
    exprs = [t["expr"] for p in dashboard["panels"] for t in p["targets"]]
    used = {m for e in exprs for m in re.findall(r"\b((?:vllm:|pagedserve_)[\w:]+)\{", e)}
    assert len(used) >= 15 and len(exprs) >= 25
    assert used <= exposed, sorted(used - exposed)
    variable = dashboard["templating"]["list"][1]
    assert variable["name"] == "model_name" and "vllm:num_requests_running" in variable["definition"]


def test_name_filter_as_torchserve(vllm_server):
    complete(vllm_server, 2, prompt="Filter " + PROMPT)
    only = scrape(
        vllm_server,
        "?name[]=vllm:num_requests_running&name[]=pagedserve_requests_total"
        "&name[]=vllm:e2e_request_latency_seconds_bucket",
    )
    # (the text parser reads each counter's and histogram's `_created` sample as a family)
    assert sorted(n for n in only if not n.endswith("_created")) == [
        "pagedserve_requests",
        "vllm:e2e_request_latency_seconds",
        "vllm:num_requests_running",
    ]
    assert "vllm:e2e_request_latency_seconds_count" in only["vllm:e2e_request_latency_seconds"]
    assert scrape(vllm_server, "?name[]=no_such_metric") == {}


def test_the_switch():
    off = ServerMetrics().render().decode()
    assert "pagedserve_requests_total" in off or "pagedserve_requests" in off
    assert "vllm:" not in off
    assert "vllm:e2e_request_latency_seconds" in ServerMetrics(vllm=True).render().decode()
    assert load_server_config(env={}).vllm_metrics is False
    assert load_server_config(env={"PAGEDSERVE_VLLM_METRICS": "true"}).vllm_metrics is True
    args = build_parser().parse_args(["serve", "--vllm-metrics"])
    assert args.vllm_metrics is True
    assert build_parser().parse_args(["serve"]).vllm_metrics is None
