"""Prometheus families of disaggregated prefill and decode (pagedserve.server.workers.disagg),
fed with each finished request's `DisaggTimings`: how requests were served (disaggregated,
local, fallen back, and why), the share that fell back, the KV moved between the workers (bytes
and seconds) and the time to first token split into its phases."""

from __future__ import annotations

from collections import Counter as Tally
from typing import TYPE_CHECKING

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

if TYPE_CHECKING:
    from pagedserve.engine.request.outputs import DisaggTimings

PHASE_BUCKETS = (0.001, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60)
PHASES = ("queue", "prefill", "transfer", "first_decode")


class DisaggMetrics:
    def __init__(self, registry: CollectorRegistry) -> None:
        r = registry
        self.requests = Counter(
            "pagedserve_disagg_requests",
            "Requests of versions with prefill/decode roles, by path (disaggregated, local, fallback) and reason",
            ["model", "path", "reason"],
            registry=r,
        )
        self.fallback_ratio = Gauge(
            "pagedserve_disagg_fallback_ratio",
            "Share of the requests meant for a hand-off that fell back to one worker's own prefill",
            ["model"],
            registry=r,
        )
        self.transfer_bytes = Counter(
            "pagedserve_disagg_transfer_bytes",
            "KV bytes moved through the connector (stored + loaded)",
            ["model"],
            registry=r,
        )
        self.transfer_time = Histogram(
            "pagedserve_disagg_transfer_seconds",
            "Per request: time moving the prompt's KV from the prefill to the decode worker",
            ["model"],
            buckets=PHASE_BUCKETS,
            registry=r,
        )
        self.ttft_phase = Histogram(
            "pagedserve_disagg_ttft_phase_seconds",
            "Time to first token of disaggregated requests, by phase (queue, prefill, transfer, first_decode)",
            ["model", "phase"],
            buckets=PHASE_BUCKETS,
            registry=r,
        )
        self._paths: Tally = Tally()  # (model, path) -> requests

    def observe(self, model: str, d: DisaggTimings) -> None:
        self.requests.labels(model, d.path.value, d.reason or "").inc()
        self._paths[(model, d.path.value)] += 1
        fallen = self._paths[(model, "fallback")]
        meant = fallen + self._paths[(model, "disaggregated")]
        self.fallback_ratio.labels(model).set(fallen / meant if meant else 0.0)
        self.transfer_bytes.labels(model).inc(d.transfer_bytes)
        if d.path.value == "disaggregated":
            self.transfer_time.labels(model).observe(d.transfer_s)
            for phase, seconds in zip(PHASES, (d.queue_s, d.prefill_s, d.transfer_s, d.first_decode_s), strict=True):
                self.ttft_phase.labels(model, phase).observe(seconds)
