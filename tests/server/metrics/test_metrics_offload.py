"""KV offload counters reach the metrics port: summed over a model's workers, hits by tier."""

from __future__ import annotations

from types import SimpleNamespace

from prometheus_client.parser import text_string_to_metric_families

from pagedserve.engine.kv_offload.stats import KVOffloadStats
from pagedserve.engine.scheduler.stats import SchedulerStats
from pagedserve.server.metrics.families import ServerMetrics
from pagedserve.server.workers.routing import Router


def _worker(hits_cpu: int, hits_disk: int, stored: int, offload: bool = True):
    counters = KVOffloadStats(
        hit_tokens_cpu=hits_cpu,
        hit_tokens_disk=hits_disk,
        stored_tokens=stored,
        loaded_bytes=10 * (hits_cpu + hits_disk),
        load_time_s=0.5,
        faults=1,
    )
    stats = SchedulerStats(num_kv_blocks=8, num_free_blocks=8, kv_offload=counters.as_dict() if offload else None)
    return SimpleNamespace(name=f"w{id(stats)}", stats=stats)


def _version(name: str, workers: list):
    return SimpleNamespace(
        name=name, version="1.0", in_flight=0, router=Router(), pool=SimpleNamespace(ready_engines=lambda: workers)
    )


def _samples(metrics: ServerMetrics) -> dict[tuple, float]:
    out = {}
    for family in text_string_to_metric_families(metrics.render().decode()):
        for s in family.samples:
            if s.name.startswith("pagedserve_kv_offload"):
                out[(s.name, tuple(sorted(s.labels.items())))] = s.value
    return out


def test_offload_counters_are_summed_per_model_and_absent_without_offload():
    versions = [
        _version("a", [_worker(32, 16, 256), _worker(0, 64, 128)]),
        _version("b", [_worker(0, 0, 0, offload=False)]),
    ]
    samples = _samples(ServerMetrics(lambda: versions))
    a = (("model", "a"), ("version", "1.0"))
    assert samples[("pagedserve_kv_offload_hit_tokens_total", tuple(sorted((*a, ("tier", "cpu")))))] == 32
    assert samples[("pagedserve_kv_offload_hit_tokens_total", tuple(sorted((*a, ("tier", "disk")))))] == 80
    assert samples[("pagedserve_kv_offload_stored_tokens_total", a)] == 384
    assert samples[("pagedserve_kv_offload_loaded_bytes_total", a)] == 1120
    assert samples[("pagedserve_kv_offload_load_time_seconds_total", a)] == 1.0
    assert samples[("pagedserve_kv_offload_faults_total", a)] == 2
    assert not [key for key in samples if ("model", "b") in key[1]]
