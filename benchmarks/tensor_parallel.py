"""Tensor parallelism on this machine: the same offline workload at TP = 1 and TP = N.

Each phase runs in a fresh process (one engine per process; the worker's threads shared among
its ranks as the engine does): load `LLM(default model, tensor_parallel_size=N, num_threads=T)`,
one warm-up request, then a timed greedy batch. The phases run as the harness's paired rounds
(run_paired: TP = 1 and TP = N once per round, the order reversed every other round); the result
is each round's ratio TP=N / TP=1 of output tokens per second and their median (paired, as the
machine's load drifts), plus whether the outputs were identical.
Results: benchmarks/results/{--out, default tensor_parallel}.<cpu-kind>.{json,md}.

    .venv/bin/python benchmarks/tensor_parallel.py --tp 3 --rounds 5
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks._common import RESULTS, make_prompts, result_path, run_phase
from pagedserve.server.commands.bench.harness import MIN_ROUNDS, provenance, run_paired, stamp


def phase(args: argparse.Namespace) -> dict:
    from pagedserve.engine import LLM, SamplingParams
    from pagedserve.engine.model.default_model import default_model_dir

    start = time.perf_counter()
    llm = LLM(
        default_model_dir(),
        dtype=args.dtype,
        tensor_parallel_size=args.phase_tp,
        num_threads=args.threads,
        kv_cache_memory="256MiB",
        max_model_len=1024,
    )
    load_s = time.perf_counter() - start
    params = SamplingParams(max_tokens=args.output_len, temperature=0, ignore_eos=True)
    llm.generate([[11, 12, 13, 14]], SamplingParams(max_tokens=4, temperature=0))  # warm-up
    prompts = json.loads(Path(args.prompts).read_text())
    start = time.perf_counter()
    outputs = llm.generate(prompts, params)
    elapsed = time.perf_counter() - start
    llm.shutdown()
    tokens = [o.outputs[0].token_ids for o in outputs]
    return {
        "tp": args.phase_tp,
        "load_s": load_s,
        "elapsed_s": elapsed,
        "output_tok_s": sum(map(len, tokens)) / elapsed,
        "outputs_sha256": hashlib.sha256(json.dumps(tokens).encode()).hexdigest(),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--tp", type=int, default=3)
    parser.add_argument("--rounds", type=int, default=MIN_ROUNDS)
    parser.add_argument("--threads", type=int, default=os.cpu_count() or 1, help="the worker's torch threads")
    parser.add_argument("--dtype", default="float32")
    parser.add_argument("--num-prompts", type=int, default=8)
    parser.add_argument("--prompt-len", type=int, default=128)
    parser.add_argument("--output-len", type=int, default=32)
    parser.add_argument("--out", default="tensor_parallel")
    parser.add_argument("--phase-tp", type=int, help=argparse.SUPPRESS)
    parser.add_argument("--prompts", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.phase_tp is not None:
        print(json.dumps(phase(args)))
        return
    from pagedserve.engine.model.default_model import default_model_dir
    from pagedserve.engine.model.tokenizer import load_tokenizer

    # Made once here: make_prompts draws from the vocabulary in its dict order, which differs
    # from one process to the next, so each phase reads the same prompts from a file.
    prompts_file = RESULTS / f".{args.out}-prompts.json"
    RESULTS.mkdir(exist_ok=True)
    prompts_file.write_text(
        json.dumps(make_prompts(load_tokenizer(default_model_dir()), args.num_prompts, args.prompt_len, seed=0))
    )
    common = [
        "--threads",
        str(args.threads),
        "--dtype",
        args.dtype,
        "--output-len",
        str(args.output_len),
        "--prompts",
        str(prompts_file),
    ]
    many = f"tp{args.tp}"
    paired = run_paired(
        "tp1",
        many,
        lambda side: run_phase(__file__, ["--phase-tp", side.removeprefix("tp"), *common]),
        metric="output_tok_s",
        rounds=args.rounds,
    )
    prompts_file.unlink()
    rounds = [
        {"tp1": one, many: other, "ratio": ratio, "identical": one["outputs_sha256"] == other["outputs_sha256"]}
        for one, other, ratio in zip(paired.runs["tp1"], paired.runs[many], paired.ratios)
    ]
    result = {
        **provenance(paired.loads),
        "settings": vars(args) | {"phase_tp": None, "prompts": None},
        "rounds": rounds,
        "median_ratio": paired.ratio_median,
        "all_identical": all(r["identical"] for r in rounds),
    }
    RESULTS.mkdir(exist_ok=True)
    result_path(f"{args.out}", "json").write_text(json.dumps(result, indent=2) + "\n")
    lines = [
        f"# Tensor parallelism: TP = {args.tp} vs TP = 1 (offline, default model, {args.dtype})",
        "",
        stamp(result),
        "",
        (
            f"{args.threads} threads per worker (shared among its ranks); {args.rounds} paired rounds, the order "
            f"alternating. {args.num_prompts} prompts x {args.prompt_len} tokens, {args.output_len} greedy output "
            "tokens each."
        ),
        "",
        f"| round | TP=1 tok/s | TP={args.tp} tok/s | ratio | identical output |",
        "| --- | --- | --- | --- | --- |",
    ]
    lines += [
        f"| {i} | {r['tp1']['output_tok_s']:.1f} | {r[f'tp{args.tp}']['output_tok_s']:.1f} | {r['ratio']:.2f} | "
        f"{r['identical']} |"
        for i, r in enumerate(rounds, 1)
    ]
    lines += [
        "",
        (
            f"Median ratio TP={args.tp} / TP=1: **{result['median_ratio']:.2f}x**; outputs identical in every "
            f"round: {result['all_identical']}."
        ),
    ]
    result_path(f"{args.out}", "md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
