"""Batch-1 decode with the tied LM head's few-rows kernel on and off (CPUs with bf16 dot products).

On such CPUs every bf16 projection is a PackedLinear (oneDNN-packed weight). The tied LM head
may instead run its one- and two-row calls through the `bf16_gemv` kernel on the embedding's
plain table (`PackedLinear(..., few_rows_gemv=...)`, what the loader does). One engine, one
process: each round decodes the same prompt greedily with the head swapped between the two, the
order flipping every round; the result is the median of the per-round tok/s ratios, every round
printed, plus the process's peak RSS. Writes benchmarks/results/tied_head_gemv.{json,md}.

    PYTHONPATH=. .venv/bin/python benchmarks/tied_head_gemv.py [--rounds 7] [--tokens 64]
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _common import RESULTS, cpu_description, peak_rss_mib  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--rounds", type=int, default=7)
    ap.add_argument("--tokens", type=int, default=64)
    ap.add_argument("--threads", type=int, default=2)
    args = ap.parse_args()

    from engine import LLM, SamplingParams
    from engine.model.default_model import default_model_dir
    from kernels.cpu_isa import cpu_has_bf16_dot
    from kernels.cpu_packed_linear import PackedLinear

    if not cpu_has_bf16_dot():
        sys.exit("this CPU has no bf16 dot products: its LM head is an UpcastLinear, not measured here")
    llm = LLM(default_model_dir(), dtype="bfloat16", num_threads=args.threads, enable_prefix_caching=False,
              kv_cache_memory="256MiB")
    model = llm.engine.runner.model
    with_gemv = model.packed_lm_head
    if getattr(with_gemv, "gemv", None) is None:
        sys.exit("the loaded LM head has no few-rows kernel (untied head, or the extension did not build)")
    heads = {"gemv": with_gemv, "packed": PackedLinear(model.model.embed_tokens.weight, None)}
    params = SamplingParams(max_tokens=args.tokens, temperature=0, ignore_eos=True)
    prompt = [list(range(1000, 1032))]

    def decode_tok_per_s(name: str) -> tuple[float, list[int]]:
        model.packed_lm_head = heads[name]
        llm.generate(prompt, SamplingParams(max_tokens=2, temperature=0, ignore_eos=True))  # warm
        start = time.perf_counter()
        out = llm.generate(prompt, params)[0].outputs[0].token_ids
        return args.tokens / (time.perf_counter() - start), list(out)

    rows, ratios, tokens = [], [], {}
    for r in range(args.rounds):
        order = ("gemv", "packed") if r % 2 == 0 else ("packed", "gemv")
        got = {}
        for name in order:
            got[name], tokens[name] = decode_tok_per_s(name)
        ratios.append(got["gemv"] / got["packed"])
        rows.append(got)
        print(f"round {r + 1}: gemv {got['gemv']:.1f} tok/s, packed {got['packed']:.1f} tok/s, "
              f"ratio {ratios[-1]:.3f}", flush=True)
    summary = {
        "rounds": rows, "per_round_ratio": ratios, "median_ratio": statistics.median(ratios),
        "same_tokens": tokens["gemv"] == tokens["packed"], "peak_rss_mib": peak_rss_mib(),
        "cpu": cpu_description(), "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()), "args": vars(args),
    }
    RESULTS.mkdir(exist_ok=True)
    (RESULTS / "tied_head_gemv.json").write_text(json.dumps(summary, indent=2) + "\n")
    md = [
        "# Tied LM head: few-rows kernel vs oneDNN packed GEMM at batch 1 (latest run)", "",
        f"Default model, bf16, {args.threads} threads, greedy decode of {args.tokens} tokens after a 32-token "
        f"prompt; {args.rounds} paired rounds in one process, order flipping every round.", "",
        "| measure | value |", "| --- | --- |",
        f"| gemv head (median tok/s) | {statistics.median(r['gemv'] for r in rows):.1f} |",
        f"| packed head (median tok/s) | {statistics.median(r['packed'] for r in rows):.1f} |",
        f"| **gemv / packed, median of per-round ratios** | **{summary['median_ratio']:.3f}x** |",
        f"| per-round ratios | {', '.join(f'{x:.3f}' for x in ratios)} |",
        f"| same greedy tokens | {summary['same_tokens']} |",
        f"| peak RSS (MiB) | {summary['peak_rss_mib']:.0f} |", "",
        f"Run on {summary['date']} ({summary['cpu']}).",
    ]
    (RESULTS / "tied_head_gemv.md").write_text("\n".join(md) + "\n")
    print("\n".join(md))


if __name__ == "__main__":
    main()
