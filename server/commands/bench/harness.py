"""The benchmark harness that `pagedserve bench` and the scripts in benchmarks/ share.

- `alternating_rounds`: every side once per round, the order reversed every other round.
- `run_paired`: paired rounds of two sides (a baseline and a candidate), the order alternating
  every round so that neither side always runs on a warmer or a quieter machine; every round's
  ratio candidate / baseline is printed, and the result is the median of the per-round ratios.
- `percentile`: a nearest-rank percentile of a few samples.
- `median_call_s`: the median time of a call of a function (micro-benchmarks).
- `peak_rss_mib` and `rss_mib`: peak and current resident memory of this process or another.
- `cpu_kind` and `cpu_description`: what the numbers were measured on; `result_path`: one
  current results file per benchmark and CPU kind (`<benchmark>.<cpu-kind>.<ext>`, the history
  is in git).
- `provenance`: the commit, the CPU and the machine's load, stamped on every result.
"""

from __future__ import annotations

import os
import platform
import resource
import subprocess
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from statistics import median
from typing import Any, TypeVar

MIN_ROUNDS = 5  # the project's bar for a paired comparison
_T = TypeVar("_T")
REPO = Path(__file__).resolve().parents[3]


@dataclass(slots=True)
class PairedRounds:
    """The records of each side, one per round, and the metric compared."""

    baseline: str
    candidate: str
    metric: str
    runs: dict[str, list[dict[str, Any]]] = field(default_factory=dict)
    orders: list[tuple[str, str]] = field(default_factory=list)  # which side ran first, per round
    loads: list[float] = field(default_factory=list)  # 1-minute load average after each round

    @property
    def ratios(self) -> list[float]:
        """candidate / baseline of `metric`, per round."""
        return [
            c[self.metric] / b[self.metric]
            for b, c in zip(self.runs[self.baseline], self.runs[self.candidate], strict=True)
        ]

    @property
    def ratio_median(self) -> float:
        return median(self.ratios)

    def side_median(self, side: str) -> float:
        return median(r[self.metric] for r in self.runs[side])

    def summary(self) -> dict[str, Any]:
        return {
            "metric": self.metric,
            "baseline": self.baseline,
            "candidate": self.candidate,
            f"{self.baseline}_median": self.side_median(self.baseline),
            f"{self.candidate}_median": self.side_median(self.candidate),
            "ratio_median": self.ratio_median,
            "ratio_per_round": self.ratios,
            "order_per_round": [list(o) for o in self.orders],
            "load_average_per_round": self.loads,
            "runs": self.runs,
        }

    def table(self, unit: str = "") -> list[str]:
        """Markdown rows: each side's median, the median ratio, every round's ratio."""
        b, c = self.baseline, self.candidate
        return [
            "| measure | value |",
            "| --- | --- |",
            f"| {b} (median) | {self.side_median(b):.1f}{unit} |",
            f"| {c} (median) | {self.side_median(c):.1f}{unit} |",
            f"| **{c} / {b}, median of the per-round ratios** | **{self.ratio_median:.3f}** |",
            "| per-round ratios | " + ", ".join(f"{r:.3f}" for r in self.ratios) + " |",
        ]


def alternating_rounds(
    sides: Sequence[str],
    measure: Callable[[str], _T],
    rounds: int,
    on_round: Callable[[int, tuple[str, ...], dict[str, list[_T]]], None] | None = None,
) -> dict[str, list[_T]]:
    """`rounds` rounds of `measure(side)` for every side: in the given order in even rounds,
    reversed in odd ones; `on_round(round, order, results so far)` after each (to print the
    round's ratios). Side -> its results, in rounds."""
    if rounds < 1:
        raise ValueError(f"rounds: must be >= 1, got {rounds}")
    out: dict[str, list[_T]] = {side: [] for side in sides}
    for r in range(rounds):
        order = tuple(sides) if r % 2 == 0 else tuple(reversed(sides))
        for side in order:
            out[side].append(measure(side))
        if on_round is not None:
            on_round(r, order, out)
    return out


def run_paired(
    baseline: str,
    candidate: str,
    measure: Callable[[str], dict[str, Any]],
    *,
    metric: str,
    rounds: int = MIN_ROUNDS,
    log: Callable[[str], None] = print,
) -> PairedRounds:
    """`rounds` rounds of `measure(side)` for both sides, baseline first in even rounds and
    candidate first in odd ones; each round's ratio is logged as it lands."""
    result = PairedRounds(baseline, candidate, metric)

    def done(r: int, order: tuple[str, ...], runs: dict[str, list[dict[str, Any]]]) -> None:
        result.orders.append((order[0], order[1]))
        result.loads.append(os.getloadavg()[0])
        b, c = runs[baseline][-1][metric], runs[candidate][-1][metric]
        log(
            f"round {r + 1} ({', '.join(order)}): {baseline} {b:.4g}, {candidate} {c:.4g}, "
            f"{candidate} / {baseline} {c / b:.3f} (load {result.loads[-1]:.1f})"
        )

    result.runs = alternating_rounds((baseline, candidate), measure, rounds, on_round=done)
    return result


def percentile(values: Sequence[float], q: float) -> float:
    """The value at quantile `q` (0..1) of `values`, the nearest rank (no interpolation: with
    few samples, p99 is the slowest one)."""
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, round(q * (len(ordered) - 1)))]


def median_call_s(fn: Callable[[], object], calls: int, warmup: int = 1) -> float:
    """The median wall time of `calls` calls of `fn`, after `warmup` untimed ones (a call that a
    busy machine descheduled does not move a median)."""
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(calls):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return median(times)


def peak_rss_mib(pid: int | None = None) -> float:
    """Peak resident memory of this process, or of process `pid` (Linux /proc)."""
    if pid is None:
        return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    return _proc_status_mib(pid, "VmHWM")


def rss_mib(pid: int) -> float:
    """Resident memory of process `pid` now (Linux /proc)."""
    return _proc_status_mib(pid, "VmRSS")


def _proc_status_mib(pid: int, key: str) -> float:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith(f"{key}:"):
            return int(line.split()[1]) / 1024
    return 0.0


def _cpuinfo() -> tuple[str, set[str], int] | None:
    try:
        text = Path("/proc/cpuinfo").read_text()
    except OSError:
        return None
    lines = text.splitlines()
    name = next((ln.split(":", 1)[1].strip() for ln in lines if ln.startswith("model name")), "")
    flags = set(next((ln.split(":", 1)[1].split() for ln in lines if ln.startswith("flags")), []))
    return name, flags, sum(ln.startswith("processor") for ln in lines)


# Every name cpu_kind() gives: x86 vendors by their matmul-relevant ISA, other machines by their
# architecture, "unknown" for the rest.
CPU_KINDS = ("zen3", "zen4", "amd", "xeon", "xeon-amx", "intel", "aarch64", "arm64", "unknown")


def cpu_kind() -> str:
    """A short name for the kind of CPU (one of CPU_KINDS): the key of a benchmark's results file."""
    info = _cpuinfo()
    if info is not None:
        name, flags, _ = info
        if "AMD" in name:
            return "zen4" if "avx512f" in flags else "zen3" if "avx2" in flags else "amd"
        if "Intel" in name:
            return "xeon-amx" if "amx_bf16" in flags else "xeon" if "avx512f" in flags else "intel"
    machine = platform.machine()
    return machine if machine in CPU_KINDS else "unknown"


def cpu_description() -> str:
    """The CPU's model name, logical CPU count and the matmul-relevant ISA flags."""
    info = _cpuinfo()
    if info is None:
        return platform.processor() or "unknown"
    name, flags, count = info
    isa = [f for f in ("avx512f", "avx512_bf16", "avx512_vnni", "amx_int8", "amx_bf16") if f in flags]
    return f"{name or 'unknown'}, {count} logical CPUs, {' '.join(isa) or 'no avx512/amx'}"


def result_path(results_dir: Path, name: str, ext: str) -> Path:
    """Where benchmark `name` keeps its current `ext` results on this kind of CPU."""
    return results_dir / f"{name}.{cpu_kind()}.{ext}"


def commit() -> str:
    """The repository's commit (with "-dirty" for uncommitted changes), or "unknown"."""
    try:
        head = subprocess.run(
            ["git", "rev-parse", "--short", "HEAD"], cwd=REPO, capture_output=True, text=True, check=True, timeout=10
        ).stdout.strip()
        dirty = subprocess.run(
            # the results files a run rewrites do not make the code it measured dirty
            ["git", "status", "--porcelain", "--untracked-files=no", "--", ".", ":!benchmarks/results"],
            cwd=REPO,
            capture_output=True,
            text=True,
            check=True,
            timeout=10,
        ).stdout.strip()
    except (OSError, subprocess.SubprocessError):
        return "unknown"
    return head + ("-dirty" if dirty else "")


def provenance(loads: Sequence[float] = ()) -> dict[str, Any]:
    """What a result names: the commit, the CPU and how busy the machine was."""
    load = max(loads) if loads else os.getloadavg()[0]
    cores = os.cpu_count() or 1
    return {
        "commit": commit(),
        "cpu": cpu_description(),
        "cpu_kind": cpu_kind(),
        "load_average": round(load, 2),
        "machine": "busy machine (other jobs running)" if load > 0.5 * cores else "quiet machine",
    }


def stamp(record: dict[str, Any]) -> str:
    """The line a results file opens with (from a record's provenance fields)."""
    return (
        f"Recorded at commit {record['commit']} on CPU: {record['cpu']} ({record['cpu_kind']}); "
        f"{record['machine']}, load average up to {record['load_average']}."
    )
