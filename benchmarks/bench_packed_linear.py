"""bf16 linear layers on CPU: F.linear (oneDNN reorders the weight every call) vs PackedLinear
(weight packed once at load), in one run.

1. Per projection of SmolLM2-135M, at 64 rows (a decode step of 64 sequences) and 2,048 rows
   (a prefill chunk): microseconds per call.
2. The engine on 64 prompts x 200 tokens, 48 output tokens (EOS ignored, greedy), with and
   without packing, in the same process.

Method (issue 14): paired rounds (at least 5) through the shared harness
(pagedserve.server.commands.bench.harness.run_paired), the two sides' order reversed every other
round; the result is the median of the per-round ratios (every one printed), never the best round.

Writes benchmarks/results/bench_packed_linear.<cpu-kind>.{md,json}; reports peak RSS.

    .venv/bin/python benchmarks/bench_packed_linear.py [--rounds 5]
"""

from __future__ import annotations

import argparse
import json
import random
import sys
import time
from dataclasses import replace
from pathlib import Path

from _common import RESULTS, peak_rss_mib, result_path

from pagedserve.server.commands.bench.harness import MIN_ROUNDS, provenance, run_paired, stamp

REPO = Path(__file__).resolve().parent.parent
# (name, out_features, in_features) of SmolLM2-135M's projections and its LM head.
SHAPES = [
    ("qkv_proj", 960, 576),
    ("o_proj", 576, 576),
    ("gate_up_proj", 3072, 576),
    ("down_proj", 576, 1536),
    ("lm_head", 49152, 576),
]


def time_call(fn, min_time: float = 0.3) -> float:
    fn()
    calls, start = 0, time.perf_counter()
    while (elapsed := time.perf_counter() - start) < min_time:
        fn()
        calls += 1
    return elapsed / max(1, calls) * 1e6


def bench_shapes(rounds: int) -> list[dict]:
    import torch
    import torch.nn.functional as F

    from pagedserve.kernels.cpu_packed_linear import PackedLinear

    rows = []
    for m in (64, 2048):
        for name, n, k in SHAPES:
            if name == "lm_head" and m > 64:
                continue  # logits are computed only for sampled positions
            x, w = torch.randn(m, k).bfloat16(), torch.randn(n, k).bfloat16()
            packed = PackedLinear(w, None)
            sides = {"plain": lambda x=x, w=w: F.linear(x, w), "packed": lambda x=x, packed=packed: packed(x)}

            def measure(side: str, sides=sides) -> dict:
                us = time_call(sides[side])
                return {"us": us, "calls_per_s": 1e6 / us}

            # packed / plain calls per second = plain / packed microseconds: the speedup
            calls = run_paired("plain", "packed", measure, metric="calls_per_s", rounds=rounds, log=lambda line: None)
            ratios = calls.ratios
            rows.append(
                {
                    "rows": m,
                    "layer": name,
                    "plain_us": replace(calls, metric="us").side_median("plain"),
                    "packed_us": replace(calls, metric="us").side_median("packed"),
                    "speedup": calls.ratio_median,
                    "per_round": ratios,
                }
            )
            print(
                f"  {m} x {name}: {rows[-1]['speedup']:.2f}x (per round " + ", ".join(f"{r:.2f}" for r in ratios) + ")",
                flush=True,
            )
    return rows


def bench_engine(rounds: int) -> dict:
    from pagedserve.engine import LLM, SamplingParams
    from pagedserve.engine.model import loader
    from pagedserve.engine.model.default_model import default_model_dir

    model = default_model_dir()
    options = {"dtype": "bfloat16", "kv_cache_memory": "1GiB", "num_threads": 2, "enable_prefix_caching": False}
    supported = loader.packed_linear_supported
    loader.packed_linear_supported = lambda: False  # this engine keeps plain F.linear weights
    try:
        plain = LLM(model, **options)
    finally:
        loader.packed_linear_supported = supported
    packed = LLM(model, **options)
    rng = random.Random(0)
    prompts = [[rng.randrange(100, 40000) for _ in range(200)] for _ in range(64)]
    params = SamplingParams(max_tokens=48, ignore_eos=True, temperature=0)

    def tok_per_s(llm) -> float:
        start = time.perf_counter()
        llm.generate(prompts, params)
        return 64 * 48 / (time.perf_counter() - start)

    engines = {"plain": plain, "packed": packed}
    result = run_paired(
        "plain", "packed", lambda side: {"tok_per_s": tok_per_s(engines[side])}, metric="tok_per_s", rounds=rounds
    )
    runs = {side: [x["tok_per_s"] for x in result.runs[side]] for side in engines}
    return {
        "runs_tok_per_s": runs,
        "median_tok_per_s": {side: result.side_median(side) for side in engines},
        "speedup": result.ratio_median,
        "per_round": result.ratios,
        "loads": result.loads,
    }


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--rounds", type=int, default=MIN_ROUNDS, help=f"paired rounds (at least {MIN_ROUNDS})")
    args = parser.parse_args()
    if args.rounds < MIN_ROUNDS:
        parser.error(f"--rounds must be at least {MIN_ROUNDS} (the result is a median of paired rounds)")
    sys.path.insert(0, str(REPO))
    import torch

    torch.set_num_threads(2)
    shapes = bench_shapes(args.rounds)
    engine = bench_engine(args.rounds)
    peak_mib = peak_rss_mib()
    summary = {
        "shapes": shapes,
        "engine": engine,
        "peak_rss_mib": peak_mib,
        "date": time.strftime("%Y-%m-%d %H:%M"),
        **provenance(engine["loads"]),
    }
    RESULTS.mkdir(exist_ok=True)
    result_path("bench_packed_linear", "json").write_text(json.dumps(summary, indent=2) + "\n")
    md = [
        "# bf16 linear on CPU: F.linear vs PackedLinear (latest run)",
        "",
        stamp(summary),
        "",
        f"2 threads; median of {args.rounds} paired rounds (order reversed every other round).",
        "",
        "| rows | layer | F.linear (us) | packed (us) | speedup |",
        "| --- | --- | --- | --- | --- |",
    ]
    md += [
        f"| {r['rows']} | {r['layer']} | {r['plain_us']:.0f} | {r['packed_us']:.0f} | {r['speedup']:.2f}x |"
        for r in shapes
    ]
    medians = engine["median_tok_per_s"]
    md += [
        "",
        "Engine, 64 prompts x 200 tokens, 48 output tokens: plain "
        f"{medians['plain']:.1f} tok/s, packed {medians['packed']:.1f} tok/s (medians); "
        f"median of the per-round ratios **{engine['speedup']:.2f}x** (per round: "
        + ", ".join(f"{r:.2f}x" for r in engine["per_round"])
        + ").",
        "",
        f"Peak RSS {peak_mib:.0f} MiB (both engines loaded). Run on {summary['date']}.",
    ]
    result_path("bench_packed_linear", "md").write_text("\n".join(md) + "\n")
    print("\n".join(md))


if __name__ == "__main__":
    main()
