"""Batch-invariant mode on vs off (EngineConfig.batch_invariant): its throughput cost, and whether
the default model's tokens change with the batch, in bf16.

Throughput: the harness's paired rounds (run_paired) run the same offline workload (prompts
together, greedy, EOS ignored) once with the mode off and once on per round, each in a fresh child
process, the order reversed every other round; the ratio on / off is taken within each round, every round's ratio is printed and the
result is their median (at least 5 rounds). One prompt alone (its prefill and batch-1 decode) is
timed the same way. Then one check per side on the same prompts: greedy tokens and logprobs alone, in one batch,
with chunked prefill (64-token budget) and again after a prefix-cache hit, compared with the
alone run.

Results: benchmarks/results/batch_invariant.<cpu-kind>.{json,md}.

    .venv/bin/python benchmarks/batch_invariant.py [--num-prompts 16] [--prompt-len 128]
        [--output-len 32] [--threads 2] [--rounds 5] [--name batch_invariant]
"""

from __future__ import annotations

import argparse
import json
import os
import random
import sys
import time
from dataclasses import replace
from pathlib import Path

from _common import RESULTS, peak_rss_mib, result_path, run_phase

from pagedserve.server.commands.bench.harness import MIN_ROUNDS, provenance, run_paired, stamp


def _prompts(args) -> list[list[int]]:
    rng = random.Random(0)
    return [[rng.randrange(1000, 30000) for _ in range(args.prompt_len)] for _ in range(args.num_prompts)]


def _llm(args, on: bool, **options):
    from pagedserve.engine import LLM

    return LLM(
        args.model,
        dtype="bfloat16",
        num_threads=args.threads,
        kv_cache_memory="512MiB",
        max_num_seqs=args.num_prompts,
        batch_invariant=on,
        **options,
    )


def throughput(args, on: bool) -> dict:
    from pagedserve.engine import SamplingParams

    prompts = _prompts(args)
    llm = _llm(args, on, enable_prefix_caching=False)
    params = SamplingParams(max_tokens=args.output_len, ignore_eos=True, temperature=0)
    llm.generate([prompts[0][:16]], SamplingParams(max_tokens=2, temperature=0))  # warm-up
    start = time.perf_counter()
    outs = llm.generate(prompts, params)
    batch_s = time.perf_counter() - start
    start = time.perf_counter()
    (one,) = llm.generate([prompts[0]], params)
    single_s = time.perf_counter() - start
    llm.shutdown()
    return {
        "tok_per_s": sum(len(o.outputs[0].token_ids) for o in outs) / batch_s,
        "batch1_tok_per_s": len(one.outputs[0].token_ids) / single_s,
        "peak_rss_mib": peak_rss_mib(),
    }


def check(args, on: bool) -> dict:
    """How many prompts give other tokens / other logprobs than alone, per configuration."""
    from pagedserve.engine import SamplingParams

    prompts = _prompts(args)[: args.check_prompts]
    params = SamplingParams(max_tokens=args.output_len, ignore_eos=True, temperature=0, logprobs=1)

    def results(outs) -> list[tuple[list[int], list]]:
        return [
            (o.outputs[0].token_ids, [sorted((k, v.logprob) for k, v in d.items()) for d in o.outputs[0].logprobs])
            for o in outs
        ]

    llm = _llm(args, on, enable_prefix_caching=False)
    alone = [results(llm.generate([p], params))[0] for p in prompts]
    runs = {"batch": results(llm.generate(prompts, params))}
    llm.shutdown()
    del llm  # one engine's weights and KV pool at a time
    chunked = _llm(args, on, enable_prefix_caching=False, max_num_batched_tokens=64)
    runs["chunked_prefill_64"] = results(chunked.generate(prompts, params))
    chunked.shutdown()
    del chunked
    cached = _llm(args, on)
    cached.generate(prompts, params)
    runs["after_prefix_hit"] = results(cached.generate(prompts, params))
    cached.shutdown()
    return {
        name: {
            "tokens_differ": sum(r[0] != a[0] for r, a in zip(got, alone)),
            "logprobs_differ": sum(r[1] != a[1] for r, a in zip(got, alone)),
        }
        for name, got in runs.items()
    }


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--model", default=None)
    parser.add_argument("--num-prompts", type=int, default=16)
    parser.add_argument("--prompt-len", type=int, default=128)
    parser.add_argument("--output-len", type=int, default=32)
    parser.add_argument("--check-prompts", type=int, default=8)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--rounds", type=int, default=MIN_ROUNDS)
    parser.add_argument("--name", default="batch_invariant", help="the results file's name")
    parser.add_argument("--phase", default=None, help=argparse.SUPPRESS)
    args = parser.parse_args()
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
    if args.model is None:
        from pagedserve.engine.model.default_model import default_model_dir

        args.model = str(default_model_dir())
    if args.phase:
        kind, side = args.phase.split("-")
        print(json.dumps((throughput if kind == "run" else check)(args, side == "on")))
        return
    if args.rounds < MIN_ROUNDS:
        parser.error(f"--rounds must be at least {MIN_ROUNDS}")
    common = ["--model", args.model, "--threads", str(args.threads), "--check-prompts", str(args.check_prompts)]
    common += ["--num-prompts", str(args.num_prompts), "--prompt-len", str(args.prompt_len)]
    common += ["--output-len", str(args.output_len)]
    paired = run_paired(
        "off",
        "on",
        lambda side: run_phase(__file__, ["--phase", f"run-{side}", *common]),
        metric="tok_per_s",
        rounds=args.rounds,
    )
    batch1 = replace(paired, metric="batch1_tok_per_s")
    runs, loads = paired.runs, paired.loads
    checks = {side: run_phase(__file__, ["--phase", f"check-{side}", *common]) for side in ("off", "on")}
    print(json.dumps(checks))
    ratios, ratios1 = paired.ratios, batch1.ratios
    summary = {
        "workload": vars(args) | {"dtype": "bfloat16"},
        **provenance(loads),
        "date": time.strftime("%Y-%m-%d %H:%M"),
        "load_average_per_round": loads,
        "throughput_ratio_median": paired.ratio_median,
        "throughput_ratio_per_round": ratios,
        "batch1_ratio_median": batch1.ratio_median,
        "batch1_ratio_per_round": ratios1,
        "checks": checks,
        "runs": runs,
    }
    med = {s: {k: replace(paired, metric=k).side_median(s) for k in runs[s][0]} for s in runs}
    md = [
        "# Batch-invariant mode on / off (latest run)",
        "",
        stamp(summary),
        "",
        f"Default model, bf16, {args.threads} torch threads; load average after each round "
        + ", ".join(f"{x:.1f}" for x in loads)
        + f" on {os.cpu_count()} cores. {args.rounds} paired rounds (fresh processes, order reversed every other "
        f"round). Throughput: {args.num_prompts} prompts x {args.prompt_len} tokens -> {args.output_len} tokens "
        "together, greedy; then the first prompt alone (its prefill and decode).",
        "",
        "| measure | off | on | on / off, median of per-round ratios | per-round ratios |",
        "| --- | --- | --- | --- | --- |",
        f"| throughput (tok/s) | {med['off']['tok_per_s']:.1f} | {med['on']['tok_per_s']:.1f} | "
        f"**{paired.ratio_median:.3f}** | {', '.join(f'{r:.3f}' for r in ratios)} |",
        f"| one prompt alone (tok/s) | {med['off']['batch1_tok_per_s']:.1f} | {med['on']['batch1_tok_per_s']:.1f} | "
        f"**{batch1.ratio_median:.3f}** | {', '.join(f'{r:.3f}' for r in ratios1)} |",
        f"| peak RSS (MiB) | {med['off']['peak_rss_mib']:.0f} | {med['on']['peak_rss_mib']:.0f} | | |",
        "",
        f"Prompts (of {args.check_prompts}) whose greedy tokens / logprobs differ from the same prompt alone:",
        "",
        "| configuration | off: tokens | off: logprobs | on: tokens | on: logprobs |",
        "| --- | --- | --- | --- | --- |",
        *(
            f"| {name} | {checks['off'][name]['tokens_differ']} | {checks['off'][name]['logprobs_differ']} | "
            f"{checks['on'][name]['tokens_differ']} | {checks['on'][name]['logprobs_differ']} |"
            for name in checks["off"]
        ),
        "",
        f"Run on {summary['date']}.",
    ]
    RESULTS.mkdir(exist_ok=True)
    result_path(args.name, "json").write_text(json.dumps(summary, indent=2) + "\n")
    result_path(args.name, "md").write_text("\n".join(md) + "\n")
    print("\n".join(md))


if __name__ == "__main__":
    main()
