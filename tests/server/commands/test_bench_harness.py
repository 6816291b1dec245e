"""The benchmark harness that `pagedserve bench` and benchmarks/ share
(pagedserve.server.commands.bench.harness): paired rounds with alternating sides, the median of
the per-round ratios, one results file per benchmark and CPU kind, and the provenance stamp."""

from __future__ import annotations

import os
import sys
from pathlib import Path

import pytest

from pagedserve.server.commands.bench import harness

REPO = Path(__file__).resolve().parents[3]


def test_paired_rounds_alternate_the_sides_and_take_the_median_of_the_per_round_ratios():
    calls: list[str] = []
    speed = {"off": [10.0, 10.0, 20.0, 10.0, 10.0], "on": [12.0, 30.0, 22.0, 11.0, 13.0]}

    def measure(side: str) -> dict:
        calls.append(side)
        return {"tok_per_s": speed[side][sum(c == side for c in calls) - 1]}

    lines: list[str] = []
    paired = harness.run_paired("off", "on", measure, metric="tok_per_s", rounds=5, log=lines.append)
    assert calls == ["off", "on", "on", "off", "off", "on", "on", "off", "off", "on"]
    assert paired.orders == [("off", "on"), ("on", "off")] * 2 + [("off", "on")]
    assert paired.ratios == pytest.approx([1.2, 3.0, 1.1, 1.1, 1.3])
    assert paired.ratio_median == pytest.approx(1.2)
    assert paired.side_median("off") == 10.0 and paired.side_median("on") == 13.0
    assert len(lines) == 5 and "on / off 3.000" in lines[1]  # every round's ratio is shown
    assert len(paired.loads) == 5
    summary = paired.summary()
    assert summary["ratio_per_round"] == paired.ratios and summary["off_median"] == 10.0
    assert any("**1.200**" in row for row in paired.table())


def test_alternating_rounds_reverse_the_order_of_any_number_of_sides():
    calls: list[str] = []
    seen: list[tuple[int, tuple[str, ...]]] = []

    def measure(side: str) -> str:
        calls.append(side)
        return f"{side}{len(calls)}"

    def on_round(r: int, order: tuple[str, ...], so_far: dict[str, list[str]]) -> None:
        seen.append((r, order))
        assert all(len(v) == r + 1 for v in so_far.values())  # the round's results are in

    out = harness.alternating_rounds(["a", "b", "c"], measure, 3, on_round=on_round)
    assert calls == ["a", "b", "c", "c", "b", "a", "a", "b", "c"]
    assert out == {"a": ["a1", "a6", "a7"], "b": ["b2", "b5", "b8"], "c": ["c3", "c4", "c9"]}
    assert seen == [(0, ("a", "b", "c")), (1, ("c", "b", "a")), (2, ("a", "b", "c"))]


def test_paired_rounds_refuse_no_round():
    with pytest.raises(ValueError, match="rounds: must be >= 1"):
        harness.run_paired("a", "b", lambda side: {"x": 1.0}, metric="x", rounds=0)


def test_one_results_file_per_benchmark_and_cpu_kind_stamped_with_commit_and_cpu(tmp_path):
    kind = harness.cpu_kind()
    assert kind and "." not in kind
    assert harness.result_path(tmp_path, "offline_throughput", "md") == tmp_path / f"offline_throughput.{kind}.md"
    sys.path.insert(0, str(REPO / "benchmarks"))
    try:
        import _common  # the scripts' module: the same path, under benchmarks/results
    finally:
        sys.path.remove(str(REPO / "benchmarks"))
    assert _common.result_path("lora", "json") == REPO / "benchmarks" / "results" / f"lora.{kind}.json"
    record = harness.provenance([0.0])
    assert record["commit"] != "unknown" and record["cpu_kind"] == kind and "logical CPUs" in record["cpu"]
    assert record["machine"] == "quiet machine"
    assert harness.provenance([1000.0])["machine"] == "busy machine (other jobs running)"
    line = harness.stamp(record)
    assert record["commit"] in line and record["cpu"] in line
    assert harness.peak_rss_mib() > 0


def test_nearest_rank_percentile_median_call_time_and_resident_memory():
    assert harness.percentile([5.0, 1.0, 3.0, 2.0, 4.0], 0.5) == 3.0
    assert harness.percentile([5.0, 1.0, 3.0], 0.99) == 5.0  # few samples: p99 is the slowest
    calls: list[int] = []
    assert harness.median_call_s(lambda: calls.append(1), calls=5, warmup=2) >= 0.0
    assert len(calls) == 7
    assert 0 < harness.rss_mib(os.getpid()) <= harness.peak_rss_mib(os.getpid())
