"""vLLM's metric names, so vLLM's Grafana dashboards and alerts work against this server.

Turned on by `vllm_metrics` (server config) or `pagedserve serve --vllm-metrics`; they are added
to the same registry as the `pagedserve_*` metrics, which stay as they are. Every family has
vLLM's `model_name` label (the registered model's name; its versions are summed). The request
figures come from each request's final output (`observe_output`, as vLLM's output processor
records finished requests); the scheduler and cache figures are read from every ready worker's
latest stats at scrape time (`VllmEngineCollector`).

Names follow vLLM's V1 engine (`vllm:num_requests_running`, `vllm:kv_cache_usage_perc`,
`vllm:prefix_cache_queries_total`, `vllm:e2e_request_latency_seconds`, ...); the older
`vllm:gpu_cache_usage_perc` and `vllm:time_per_output_token_seconds` that vLLM's example
dashboard still queries are kept as aliases of `kv_cache_usage_perc` and of the inter-token
latency.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import TYPE_CHECKING

from prometheus_client import CollectorRegistry, Counter, Histogram
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

if TYPE_CHECKING:
    from pagedserve.engine.request.outputs import RequestOutput
    from pagedserve.server.workers.version import ModelVersion

LABEL = "model_name"
# Seconds; wide enough for a CPU-only machine's long requests.
REQUEST_BUCKETS = (
    0.3,
    0.5,
    0.8,
    1.0,
    1.5,
    2.0,
    2.5,
    5.0,
    10.0,
    15.0,
    20.0,
    30.0,
    40.0,
    50.0,
    60.0,
    120.0,
    240.0,
    480.0,
    960.0,
    1920.0,
    7680.0,
)
TTFT_BUCKETS = (
    0.001,
    0.005,
    0.01,
    0.02,
    0.04,
    0.06,
    0.08,
    0.1,
    0.25,
    0.5,
    0.75,
    1.0,
    2.5,
    5.0,
    7.5,
    10.0,
    20.0,
    40.0,
    80.0,
    160.0,
    640.0,
    2560.0,
)
TOKEN_GAP_BUCKETS = (
    0.01,
    0.025,
    0.05,
    0.075,
    0.1,
    0.15,
    0.2,
    0.3,
    0.4,
    0.5,
    0.75,
    1.0,
    2.5,
    5.0,
    7.5,
    10.0,
    20.0,
    40.0,
    80.0,
)


def buckets_1_2_5(limit: int) -> tuple[int, ...]:
    """1, 2, 5, 10, 20, 50, ... up to `limit` (token-count histograms)."""
    out: list[int] = []
    scale = 1
    while True:
        for m in (1, 2, 5):
            if m * scale > limit:
                return tuple(out)
            out.append(m * scale)
        scale *= 10


TOKEN_COUNT_BUCKETS = buckets_1_2_5(200_000)


class VllmMetrics:
    """The request-level `vllm:` families, registered in `registry`; with `versions`, also the
    engine-level ones (scheduler state, KV cache, prefix cache, preemptions, speculation)."""

    def __init__(self, registry: CollectorRegistry, versions: Callable[[], list[ModelVersion]] | None = None) -> None:
        def hist(name: str, doc: str, buckets) -> Histogram:
            return Histogram(f"vllm:{name}", doc, [LABEL], buckets=buckets, registry=registry)

        def counter(name: str, doc: str, extra: tuple[str, ...] = ()) -> Counter:
            return Counter(f"vllm:{name}", doc, [LABEL, *extra], registry=registry)

        self.e2e = hist(
            "e2e_request_latency_seconds",
            "End to end request latency in seconds (arrival to last token)",
            REQUEST_BUCKETS,
        )
        self.ttft = hist("time_to_first_token_seconds", "Time to first token in seconds", TTFT_BUCKETS)
        self.itl = hist("inter_token_latency_seconds", "Inter-token latency in seconds", TOKEN_GAP_BUCKETS)
        self.tpot_alias = hist(
            "time_per_output_token_seconds", "Inter-token latency in seconds (vLLM's older name)", TOKEN_GAP_BUCKETS
        )
        self.request_tpot = hist(
            "request_time_per_output_token_seconds",
            "Decode time per output token after the first, per request",
            TOKEN_GAP_BUCKETS,
        )
        self.queue = hist("request_queue_time_seconds", "Time spent waiting before first scheduled", REQUEST_BUCKETS)
        self.prefill = hist("request_prefill_time_seconds", "Time from first scheduled to first token", REQUEST_BUCKETS)
        self.decode = hist("request_decode_time_seconds", "Time from first token to last token", REQUEST_BUCKETS)
        self.inference = hist(
            "request_inference_time_seconds", "Time from first scheduled to last token", REQUEST_BUCKETS
        )
        self.prompt_len = hist("request_prompt_tokens", "Prompt tokens per request", TOKEN_COUNT_BUCKETS)
        self.generation_len = hist(
            "request_generation_tokens", "Generated tokens per request (all choices)", TOKEN_COUNT_BUCKETS
        )
        self.max_generation_len = hist(
            "request_max_num_generation_tokens", "Generated tokens of a request's longest choice", TOKEN_COUNT_BUCKETS
        )
        self.params_n = hist("request_params_n", "The n (choices) of each request", (1, 2, 5, 10, 20))
        self.success = counter("request_success", "Finished requests (choices) by finish reason", ("finished_reason",))
        self.prompt_tokens = counter("prompt_tokens", "Prompt tokens processed")
        self.generation_tokens = counter("generation_tokens", "Tokens generated")
        if versions is not None:
            registry.register(VllmEngineCollector(versions))

    def observe_output(self, model: str, output: RequestOutput) -> None:
        """Record a finished request: its phases, lengths and how each choice ended."""
        lengths = [len(c.token_ids) for c in output.outputs]
        generated, longest = sum(lengths), max(lengths, default=0)
        self.prompt_len.labels(model).observe(len(output.prompt_token_ids))
        self.generation_len.labels(model).observe(generated)
        self.max_generation_len.labels(model).observe(longest)
        self.params_n.labels(model).observe(len(output.outputs))
        self.prompt_tokens.labels(model).inc(len(output.prompt_token_ids))
        self.generation_tokens.labels(model).inc(generated)
        for c in output.outputs:
            if c.finish_reason is not None:
                self.success.labels(model, str(c.finish_reason)).inc()
        m = output.metrics
        if m is None:
            return
        self.e2e.labels(model).observe(max(0.0, m.finished_time - m.arrival_time))
        self.ttft.labels(model).observe(m.ttft_s)
        self.queue.labels(model).observe(m.queued_s)
        self.prefill.labels(model).observe(m.prefill_s)
        self.decode.labels(model).observe(m.decode_s)
        self.inference.labels(model).observe(m.prefill_s + m.decode_s)
        for gap in m.itl_s:
            self.itl.labels(model).observe(max(0.0, gap))
            self.tpot_alias.labels(model).observe(max(0.0, gap))
        if longest > 1:
            self.request_tpot.labels(model).observe(m.decode_s / (longest - 1))


class VllmEngineCollector:
    """vLLM's scheduler and cache families per model name, summed over its versions' ready
    workers, read at scrape time. The counters are the workers' own running totals (a restarted
    worker starts again from 0, which Prometheus' rate() reads as a counter reset)."""

    def __init__(self, versions: Callable[[], list[ModelVersion]]) -> None:
        self._versions = versions

    def describe(self) -> list:
        return []  # families are built per scrape

    def collect(self) -> Iterator:
        labels = [LABEL]
        gauges = {
            "running": GaugeMetricFamily(
                "vllm:num_requests_running", "Requests in model execution batches", labels=labels
            ),
            "waiting": GaugeMetricFamily(
                "vllm:num_requests_waiting", "Requests waiting to be scheduled", labels=labels
            ),
            "kv": GaugeMetricFamily("vllm:kv_cache_usage_perc", "KV-cache usage: 1 means 100 percent", labels=labels),
            "kv_alias": GaugeMetricFamily(
                "vllm:gpu_cache_usage_perc", "KV-cache usage: 1 means 100 percent (vLLM's older name)", labels=labels
            ),
        }
        counters = {
            "queries": CounterMetricFamily(
                "vllm:prefix_cache_queries", "Prompt tokens looked up in the prefix cache", labels=labels
            ),
            "hits": CounterMetricFamily(
                "vllm:prefix_cache_hits", "Prompt tokens found in the prefix cache", labels=labels
            ),
            "preemptions": CounterMetricFamily("vllm:num_preemptions", "Requests preempted", labels=labels),
            "drafts": CounterMetricFamily(
                "vllm:spec_decode_num_draft_tokens", "Speculative draft tokens verified", labels=labels
            ),
            "accepted": CounterMetricFamily(
                "vllm:spec_decode_num_accepted_tokens", "Speculative draft tokens kept", labels=labels
            ),
        }
        by_model: dict[str, list] = {}
        for v in self._versions():
            stats = [e.stats for e in v.pool.ready_engines() if e.stats is not None]
            by_model.setdefault(v.name, []).extend(stats)
        for name, stats in by_model.items():
            blocks = sum(s.num_kv_blocks for s in stats)
            used = sum(s.num_kv_blocks - s.num_free_blocks for s in stats)
            usage = used / blocks if blocks else 0.0
            gauges["running"].add_metric([name], sum(s.num_running for s in stats))
            gauges["waiting"].add_metric([name], sum(s.num_waiting for s in stats))
            gauges["kv"].add_metric([name], usage)
            gauges["kv_alias"].add_metric([name], usage)
            counters["queries"].add_metric([name], sum(s.prefix_cache_queries for s in stats))
            counters["hits"].add_metric([name], sum(s.prefix_cache_hits for s in stats))
            counters["preemptions"].add_metric([name], sum(s.num_preemptions for s in stats))
            counters["drafts"].add_metric([name], sum(s.spec_draft_tokens for s in stats))
            counters["accepted"].add_metric([name], sum(s.spec_accepted_tokens for s in stats))
        yield from gauges.values()
        yield from counters.values()
