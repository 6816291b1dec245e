"""Async scheduling on vs off: offline throughput of the same engine, paired rounds.

Each round runs the engine once with `async_scheduling` off and once on, each in a fresh child
process, the order reversed every other round; the ratio on / off is taken within each round and
the result is the median of the per-round ratios (at least 5 rounds), every round's ratio printed.
Outputs are greedy with EOS ignored, so both sides compute the same tokens (checked).
Results go to benchmarks/results/<name>.{json,md}.

    .venv/bin/python benchmarks/async_scheduling.py [--num-prompts 16] [--prompt-len 100]
        [--output-len 32] [--threads 2] [--dtype bfloat16] [--rounds 5] [--name async_scheduling]
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import random
import sys
import time
from pathlib import Path

from _common import RESULTS, result_path, run_phase

from pagedserve.server.commands.bench.harness import MIN_ROUNDS, provenance, run_paired, stamp


def phase(args, async_scheduling: bool) -> dict:
    from pagedserve.engine import LLM, SamplingParams

    # Seeded token ids: _common.make_prompts draws words from the tokenizer's vocabulary in its
    # dict order, which differs between processes, and the two sides must run the same prompts.
    rng = random.Random(0)
    prompts = [[rng.randrange(1000, 30000) for _ in range(args.prompt_len)] for _ in range(args.num_prompts)]
    llm = LLM(
        args.model,
        dtype=args.dtype,
        num_threads=args.threads,
        kv_cache_memory="512MiB",
        max_num_seqs=len(prompts),
        async_scheduling=async_scheduling,
    )
    params = SamplingParams(max_tokens=args.output_len, ignore_eos=True, temperature=0)
    llm.generate([prompts[0][:16]], SamplingParams(max_tokens=2, temperature=0))  # warm-up
    start = time.perf_counter()
    outs = llm.generate(prompts, params)
    elapsed = time.perf_counter() - start
    llm.shutdown()
    tokens = [o.outputs[0].token_ids for o in outs]
    n_out = sum(len(t) for t in tokens)
    return {
        "elapsed_s": elapsed,
        "tok_per_s": n_out / elapsed,
        "tokens_digest": hashlib.sha256(str(tokens).encode()).hexdigest()[:16],
    }


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--model", default=None)
    parser.add_argument("--num-prompts", type=int, default=16)
    parser.add_argument("--prompt-len", type=int, default=100)
    parser.add_argument("--output-len", type=int, default=32)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--dtype", default="bfloat16", choices=("bfloat16", "float32"))
    parser.add_argument("--rounds", type=int, default=MIN_ROUNDS)
    parser.add_argument("--name", default="async_scheduling")
    parser.add_argument("--phase", default=None, help=argparse.SUPPRESS)
    args = parser.parse_args()
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
    if args.model is None:
        from pagedserve.engine.model.default_model import default_model_dir

        args.model = str(default_model_dir())
    if args.phase:
        print(json.dumps(phase(args, args.phase == "on")))
        return
    if args.rounds < MIN_ROUNDS:
        parser.error(f"--rounds must be at least {MIN_ROUNDS}")
    common = [
        "--model",
        args.model,
        "--num-prompts",
        str(args.num_prompts),
        "--prompt-len",
        str(args.prompt_len),
        "--output-len",
        str(args.output_len),
        "--threads",
        str(args.threads),
        "--dtype",
        args.dtype,
    ]
    paired = run_paired(
        "off",
        "on",
        lambda side: run_phase(__file__, ["--phase", side, *common]),
        metric="tok_per_s",
        rounds=args.rounds,
    )
    if len({x["tokens_digest"] for v in paired.runs.values() for x in v}) != 1:
        raise SystemExit("async scheduling changed the output tokens")
    summary = {
        "workload": {
            "num_prompts": args.num_prompts,
            "prompt_len": args.prompt_len,
            "output_len": args.output_len,
            "dtype": args.dtype,
            "threads": args.threads,
        },
        "date": time.strftime("%Y-%m-%d %H:%M"),
        **provenance(paired.loads),
        **paired.summary(),
    }
    md = [
        "# Async scheduling on / off (latest run)",
        "",
        stamp(summary),
        "",
        (
            f"{args.num_prompts} prompts x {args.prompt_len} tokens -> {args.output_len} tokens, {args.dtype}, "
            f"{args.threads} torch threads, greedy, same tokens on both sides; {args.rounds} paired rounds (fresh "
            "processes, order reversed every other round). Load average after each round: "
            + ", ".join(f"{x:.1f}" for x in paired.loads)
            + f" on {os.cpu_count()} cores."
        ),
        "",
        *paired.table(" tok/s"),
        "",
        f"Run on {summary['date']}.",
    ]
    RESULTS.mkdir(exist_ok=True)
    result_path(f"{args.name}", "json").write_text(json.dumps(summary, indent=2) + "\n")
    result_path(f"{args.name}", "md").write_text("\n".join(md) + "\n")
    print("\n".join(md))


if __name__ == "__main__":
    main()
