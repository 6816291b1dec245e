"""A benchmark level's numbers from its request results: throughput, latency percentiles (TTFT,
TPOT, ITL, end to end; in milliseconds) and goodput against service-level objectives."""

from __future__ import annotations

from collections.abc import Mapping, Sequence

import numpy as np

from pagedserve.server.commands.bench.client import RequestResult

# SLO keys (vLLM's `--goodput` names) -> how to read a result, in milliseconds.
SLO_METRICS = {
    "ttft": lambda r: r.ttft_s * 1000,
    "tpot": lambda r: (r.tpot_s or 0.0) * 1000,
    "e2el": lambda r: r.e2e_s * 1000,
}


def parse_slos(items: Sequence[str] | None) -> dict[str, float]:
    """["ttft:500", "tpot:50"] -> {"ttft": 500.0, "tpot": 50.0} (milliseconds)."""
    slos: dict[str, float] = {}
    for item in items or ():
        key, sep, value = item.partition(":")
        if not sep or key not in SLO_METRICS:
            raise ValueError(f"goodput: {item!r} is not KEY:MILLISECONDS with KEY one of {', '.join(SLO_METRICS)}")
        try:
            slos[key] = float(value)
        except ValueError:
            raise ValueError(f"goodput: {item!r}: {value!r} is not a number") from None
        if slos[key] <= 0:
            raise ValueError(f"goodput: {item!r}: the objective must be > 0 ms")
    return slos


def parse_percentiles(text: str) -> list[float]:
    try:
        values = [float(p) for p in text.split(",") if p.strip()]
    except ValueError:
        raise ValueError(f"percentiles: {text!r} is not a comma-separated list of numbers") from None
    if not values or any(not 0 < p <= 100 for p in values):
        raise ValueError(f"percentiles: each must be in (0, 100], got {text!r}")
    return values


def distribution(values_ms: Sequence[float], percentiles: Sequence[float]) -> dict[str, float]:
    """mean, median, std and each percentile (`p99`, `p99.9`) of `values_ms` (0 when empty)."""
    arr = np.asarray(values_ms, dtype=float)
    if arr.size == 0:
        arr = np.zeros(1)
    out = {"mean": float(arr.mean()), "median": float(np.median(arr)), "std": float(arr.std())}
    for p in percentiles:
        out[f"p{p:g}"] = float(np.percentile(arr, p))
    return out


def meets(result: RequestResult, slos: Mapping[str, float]) -> bool:
    return result.ok and all(SLO_METRICS[k](result) <= limit for k, limit in slos.items())


def summarize(
    results: Sequence[RequestResult], duration_s: float, percentiles: Sequence[float], slos: Mapping[str, float]
) -> dict:
    """The numbers of one level (one concurrency or request rate)."""
    done = [r for r in results if r.ok]
    prompt_tokens = sum(r.prompt_tokens for r in done)
    output_tokens = sum(r.output_tokens for r in done)
    duration_s = max(duration_s, 1e-9)
    summary = {
        "completed": len(done),
        "failed": len(results) - len(done),
        "duration_s": duration_s,
        "total_input_tokens": prompt_tokens,
        "total_output_tokens": output_tokens,
        "request_throughput": len(done) / duration_s,
        "output_throughput": output_tokens / duration_s,
        "total_token_throughput": (prompt_tokens + output_tokens) / duration_s,
        "ttft_ms": distribution([r.ttft_s * 1000 for r in done], percentiles),
        "tpot_ms": distribution([r.tpot_s * 1000 for r in done if r.tpot_s is not None], percentiles),
        "itl_ms": distribution([g * 1000 for r in done for g in r.itl_s], percentiles),
        "e2el_ms": distribution([r.e2e_s * 1000 for r in done], percentiles),
        "errors": sorted({r.error for r in results if r.error})[:5],
    }
    if slos:
        good = sum(meets(r, slos) for r in results)
        summary["good_requests"] = good
        summary["goodput"] = good / duration_s
    return summary
