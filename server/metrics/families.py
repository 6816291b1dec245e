"""Prometheus metrics: request counts and latencies, and engine figures per model.

`ServerMetrics` owns its own `CollectorRegistry` (no module-level state). Histograms of time to
first token, inter-token latency, time per output token and queue time are fed with each
request's final output (`observe_output`); the engine gauges (running and waiting requests, KV
blocks used and free, prefix cache hit rate, preemptions) are read from every worker's latest
`stats` at scrape time by a custom collector. With `vllm=True` the `vllm:` families of
`pagedserve.server.metrics.vllm` are added beside these. `render(names)` keeps only the named families, as
TorchServe's `GET /metrics?name[]=...` does. The router's counters per worker (requests
routed, prefix-affinity hits) and each worker's prefix-cache hit tokens are collected too.
"""

from __future__ import annotations

from collections.abc import Callable, Collection, Iterator
from typing import TYPE_CHECKING

from aiohttp import web
from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from prometheus_client.exposition import CONTENT_TYPE_LATEST

from pagedserve.server.metrics.disagg import DisaggMetrics
from pagedserve.server.metrics.vllm import VllmMetrics

if TYPE_CHECKING:
    from pagedserve.engine.request.outputs import RequestOutput
    from pagedserve.server.workers.version import ModelVersion

LATENCY_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120, 300)
TOKEN_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.02, 0.04, 0.08, 0.15, 0.3, 0.6, 1.2, 2.5, 5, 10)


class ServerMetrics:
    def __init__(self, versions: Callable[[], list[ModelVersion]] | None = None, vllm: bool = False) -> None:
        self.registry = CollectorRegistry(auto_describe=True)
        r = self.registry
        self.requests = Counter(
            "pagedserve_requests", "HTTP requests answered", ["model", "endpoint", "status"], registry=r
        )
        self.request_latency = Histogram(
            "pagedserve_request_latency_seconds",
            "Time to answer a request (whole response)",
            ["model", "endpoint"],
            buckets=LATENCY_BUCKETS,
            registry=r,
        )
        self.queue_time = Histogram(
            "pagedserve_queue_time_seconds",
            "Time from arrival to first scheduling in the engine",
            ["model"],
            buckets=LATENCY_BUCKETS,
            registry=r,
        )
        self.ttft = Histogram(
            "pagedserve_time_to_first_token_seconds",
            "Time to first token",
            ["model"],
            buckets=LATENCY_BUCKETS,
            registry=r,
        )
        self.itl = Histogram(
            "pagedserve_inter_token_latency_seconds",
            "Gap between consecutive output tokens",
            ["model"],
            buckets=TOKEN_BUCKETS,
            registry=r,
        )
        self.tpot = Histogram(
            "pagedserve_time_per_output_token_seconds",
            "Decode time divided by output tokens after the first",
            ["model"],
            buckets=TOKEN_BUCKETS,
            registry=r,
        )
        self.prompt_tokens = Counter("pagedserve_prompt_tokens", "Prompt tokens processed", ["model"], registry=r)
        self.generation_tokens = Counter("pagedserve_generation_tokens", "Tokens generated", ["model"], registry=r)
        self.disagg = DisaggMetrics(r)
        self.prefix_cache_misses = Counter(
            "pagedserve_prefix_cache_misses",
            "Requests whose full prompt blocks were not all reused from the prefix cache, by the cause "
            "of the first missed block (first_seen, evicted, salt_differs, lora_differs, group_not_cached)",
            ["model", "cause"],
            registry=r,
        )
        self.prefix_cache_missed_tokens = Counter(
            "pagedserve_prefix_cache_missed_tokens",
            "Prompt tokens in full blocks not reused from the prefix cache, by cause",
            ["model", "cause"],
            registry=r,
        )
        if versions is not None:
            r.register(EngineCollector(versions))
        self.vllm = VllmMetrics(r, versions) if vllm else None

    def observe_request(self, model: str | None, endpoint: str, status: int, latency_s: float) -> None:
        label = model or ""
        self.requests.labels(label, endpoint, str(status)).inc()
        self.request_latency.labels(label, endpoint).observe(max(0.0, latency_s))

    def observe_output(self, model: str, output: RequestOutput) -> None:
        """Record a request's final output: its timings and token counts."""
        m = output.metrics
        if m is not None:
            self.queue_time.labels(model).observe(m.queued_s)
            self.ttft.labels(model).observe(m.ttft_s)
            for gap in m.itl_s:
                self.itl.labels(model).observe(max(0.0, gap))
        num_out = sum(len(c.token_ids) for c in output.outputs)
        self.prompt_tokens.labels(model).inc(len(output.prompt_token_ids))
        self.generation_tokens.labels(model).inc(num_out)
        if output.prefix_miss is not None:
            cause, tokens = output.prefix_miss
            self.prefix_cache_misses.labels(model, cause).inc()
            self.prefix_cache_missed_tokens.labels(model, cause).inc(tokens)
        per_seq = max((len(c.token_ids) for c in output.outputs), default=0)
        if m is not None and per_seq > 1:
            self.tpot.labels(model).observe(m.decode_s / (per_seq - 1))
        if output.disagg is not None:
            self.disagg.observe(model, output.disagg)
        if self.vllm is not None:
            self.vllm.observe_output(model, output)

    def render(self, names: Collection[str] = ()) -> bytes:
        """The Prometheus text of every family, or only of those in `names` (a family matches
        by its name or the name of any of its samples, such as `x_total` or `x_bucket`)."""
        if not names:
            return generate_latest(self.registry)
        return generate_latest(_Only(self.registry, frozenset(names)))


class _Only:
    """The families of a registry that `names` asks for (a collector for `generate_latest`)."""

    SUFFIXES = ("total", "created", "bucket", "count", "sum", "info")  # sample name suffixes

    def __init__(self, registry: CollectorRegistry, names: frozenset[str]) -> None:
        self._registry = registry
        self._names = names

    def collect(self) -> Iterator:
        for family in self._registry.collect():
            if family.name in self._names or any(f"{family.name}_{suffix}" in self._names for suffix in self.SUFFIXES):
                yield family


# (stats field, family key / name suffix, help, extra labels); hit tokens first, by tier.
_OFFLOAD_COUNTERS: tuple[tuple[str, str, str, list[str]], ...] = (
    ("hit_tokens", "hit_tokens", "Prompt tokens restored from the KV offload tiers", ["tier"]),
    ("stored_tokens", "stored_tokens", "Prompt tokens stored to the KV offload tiers", []),
    ("loaded_bytes", "loaded_bytes", "Bytes of KV restored from the offload tiers", []),
    ("stored_bytes", "stored_bytes", "Bytes of KV stored to the offload tiers", []),
    ("load_time_s", "load_time_seconds", "Time spent restoring KV from the offload tiers", []),
    ("store_time_s", "store_time_seconds", "Time spent storing KV to the offload tiers", []),
    ("faults", "faults", "Offload failures absorbed by recomputing", []),
)
_OFFLOAD_FIELDS = ("hit_tokens_cpu", "hit_tokens_disk", "hit_tokens_remote", *(c[0] for c in _OFFLOAD_COUNTERS[1:]))


class EngineCollector:
    """Engine gauges per model version, summed over its workers, read at scrape time."""

    def __init__(self, versions: Callable[[], list[ModelVersion]]) -> None:
        self._versions = versions

    def describe(self) -> list:
        return []  # families are built per scrape

    def collect(self) -> Iterator:
        labels = ["model", "version"]
        fams: dict[str, GaugeMetricFamily | CounterMetricFamily] = {
            "workers": GaugeMetricFamily("pagedserve_workers_ready", "Ready workers", labels=labels),
            "running": GaugeMetricFamily(
                "pagedserve_num_requests_running", "Requests running in the engines", labels=labels
            ),
            "waiting": GaugeMetricFamily(
                "pagedserve_num_requests_waiting", "Requests waiting in the engines", labels=labels
            ),
            "in_flight": GaugeMetricFamily(
                "pagedserve_requests_in_flight", "Requests admitted and not yet answered", labels=labels
            ),
            "used": GaugeMetricFamily("pagedserve_kv_blocks_used", "KV blocks in use", labels=labels),
            "free": GaugeMetricFamily(
                "pagedserve_kv_blocks_free", "KV blocks free (cached-but-unreferenced included)", labels=labels
            ),
            "hit_rate": GaugeMetricFamily(
                "pagedserve_prefix_cache_hit_rate",
                "Prompt tokens served from the prefix cache / queried (since start)",
                labels=labels,
            ),
            "preemptions": CounterMetricFamily(
                "pagedserve_preemptions", "Requests preempted (since the workers started)", labels=labels
            ),
            "spec_draft": CounterMetricFamily(
                "pagedserve_spec_decode_draft_tokens", "Speculative draft tokens verified", labels=labels
            ),
            "spec_accepted": CounterMetricFamily(
                "pagedserve_spec_decode_accepted_tokens", "Speculative draft tokens kept", labels=labels
            ),
            "spec_drafted": CounterMetricFamily(
                "pagedserve_spec_decode_requests_drafted",
                "Decode steps of a request given drafts (method auto)",
                labels=labels,
            ),
            "spec_skipped": CounterMetricFamily(
                "pagedserve_spec_decode_requests_skipped",
                "Decode steps of a request given no drafts (method auto)",
                labels=labels,
            ),
            "spec_rate": GaugeMetricFamily(
                "pagedserve_spec_decode_acceptance_rate",
                "Per-token draft acceptance rate, recent (method auto)",
                labels=labels,
            ),
            "spec_suffix_bytes": GaugeMetricFamily(
                "pagedserve_spec_decode_suffix_global_bytes",
                "Memory of the global suffix tries (upper bound)",
                labels=labels,
            ),
        }
        worker_labels = [*labels, "worker"]
        routing = {
            "routed": CounterMetricFamily(
                "pagedserve_routed_requests", "Requests the front end sent to each worker", labels=worker_labels
            ),
            "hits": CounterMetricFamily(
                "pagedserve_route_prefix_hits",
                "Requests sent to a worker because it held their prefix (routing: prefix_affinity)",
                labels=worker_labels,
            ),
            "hit_blocks": CounterMetricFamily(
                "pagedserve_route_prefix_hit_blocks",
                "Prompt blocks the chosen worker was known to hold",
                labels=worker_labels,
            ),
            "cached": CounterMetricFamily(
                "pagedserve_worker_prefix_cache_hit_tokens",
                "Prompt tokens each worker served from its prefix cache (since it started)",
                labels=worker_labels,
            ),
        }
        offload = {
            key: CounterMetricFamily(f"pagedserve_kv_offload_{name}", doc, labels=labels + extra)
            for key, name, doc, extra in _OFFLOAD_COUNTERS
        }
        for v in self._versions():
            key = [v.name, v.version]
            engines = v.pool.ready_engines()
            stats = [e.stats for e in engines if e.stats is not None]
            queries = sum(s.prefix_cache_queries for s in stats)
            hits = sum(s.prefix_cache_hits for s in stats)
            fams["workers"].add_metric(key, len(engines))
            fams["running"].add_metric(key, sum(s.num_running for s in stats))
            fams["waiting"].add_metric(key, sum(s.num_waiting for s in stats))
            fams["in_flight"].add_metric(key, v.in_flight)
            fams["used"].add_metric(key, sum(s.num_kv_blocks - s.num_free_blocks for s in stats))
            fams["free"].add_metric(key, sum(s.num_free_blocks for s in stats))
            fams["hit_rate"].add_metric(key, hits / queries if queries else 0.0)
            fams["preemptions"].add_metric(key, sum(s.num_preemptions for s in stats))
            fams["spec_draft"].add_metric(key, sum(s.spec_draft_tokens for s in stats))
            fams["spec_accepted"].add_metric(key, sum(s.spec_accepted_tokens for s in stats))
            fams["spec_drafted"].add_metric(key, sum(s.spec_requests_drafted for s in stats))
            fams["spec_skipped"].add_metric(key, sum(s.spec_requests_skipped for s in stats))
            rates = [s.spec_acceptance_rate for s in stats if s.spec_acceptance_rate is not None]
            fams["spec_rate"].add_metric(key, sum(rates) / len(rates) if rates else 0.0)
            fams["spec_suffix_bytes"].add_metric(key, sum(s.spec_suffix_global_bytes for s in stats))
            router = v.router
            for worker in sorted({*router.routed, *(e.name for e in engines)}):
                routing["routed"].add_metric([*key, worker], router.routed[worker])
                routing["hits"].add_metric([*key, worker], router.prefix_hits[worker])
                routing["hit_blocks"].add_metric([*key, worker], router.prefix_hit_blocks[worker])
            for engine in engines:
                if engine.stats is not None:
                    routing["cached"].add_metric([*key, engine.name], engine.stats.prefix_cache_hits)
            offloads = [s.kv_offload for s in stats if s.kv_offload]
            if offloads:
                total = {k: sum(o.get(k, 0) for o in offloads) for k in _OFFLOAD_FIELDS}
                offload["hit_tokens"].add_metric([*key, "cpu"], total["hit_tokens_cpu"])
                offload["hit_tokens"].add_metric([*key, "disk"], total["hit_tokens_disk"])
                offload["hit_tokens"].add_metric([*key, "remote"], total["hit_tokens_remote"])
                for field_name, *_ in _OFFLOAD_COUNTERS[1:]:
                    offload[field_name].add_metric(key, total[field_name])
        yield from fams.values()
        yield from routing.values()
        yield from (fam for fam in offload.values() if fam.samples)


METRICS_KEY = web.AppKey("pagedserve_metrics", ServerMetrics)


async def _metrics(request: web.Request) -> web.Response:
    body = request.app[METRICS_KEY].render(request.query.getall("name[]", ()))
    return web.Response(body=body, headers={"Content-Type": CONTENT_TYPE_LATEST})


def build_metrics_app(metrics: ServerMetrics) -> web.Application:
    """The metrics port: `GET /metrics` in Prometheus text format, no token needed;
    `?name[]=A&name[]=B` keeps only those families."""
    app = web.Application()
    app[METRICS_KEY] = metrics
    app.router.add_get("/metrics", _metrics)
    return app
