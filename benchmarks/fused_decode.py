"""The fused decode layers (engine/model/fused_decode.py) on and off: batch-1 decode tokens/s of
the default model and the dispatcher calls one decode step costs, in paired rounds.

Each round runs both sides in fresh child processes, the order alternating; the fused side is
the engine as shipped, the reference side the same with `PAGEDSERVE_FUSED_DECODE=0`.
- decode: a 32-token prompt, then `--decode-tokens` greedy tokens; the rate is
  (N - 1) / (time(N tokens) - time(1 token)), so the prefill is excluded;
- dispatcher calls per decode step: torch.profiler's recorded ops (every event named `ns::op`:
  aten, mkldnn, the project's custom ops) over a run of K + 1 tokens minus a run of 1 token,
  divided by K (so the prefill step and the request's setup cancel out); counted once per side
  in the first round (it does not vary).

`--quantization int8|int4` compares the fused and unfused paths of that mode.

Writes benchmarks/results/fused_decode_<dtype>[_<quantization>].<cpu kind>.{json,md}.
    PYTHONPATH=. OMP_NUM_THREADS=2 python benchmarks/fused_decode.py --dtype float32 --threads 2
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from benchmarks._common import make_prompts, peak_rss_mib, provenance, result_path, stamp  # noqa: E402
from pagedserve.server.commands.bench.harness import PairedRounds, run_paired  # noqa: E402

SIDES = ("fused", "reference")


def phase(args) -> dict:
    import torch
    from transformers import AutoTokenizer

    from pagedserve.engine import LLM, SamplingParams
    from pagedserve.engine.model.default_model import default_model_dir

    model_dir = default_model_dir()
    prompt = make_prompts(AutoTokenizer.from_pretrained(model_dir), 1, 32, seed=1)[0]
    llm = LLM(
        model_dir,
        dtype=args.dtype,
        num_threads=args.threads,
        kv_cache_memory="256MiB",
        max_model_len=2048,
        enable_prefix_caching=False,
        quantization=args.quantization,
    )
    fused = llm.engine.runner.model.fused_decode

    def run(n: int) -> tuple[float, float]:
        params = SamplingParams(max_tokens=n, ignore_eos=True, temperature=0)
        t0, c0 = time.perf_counter(), time.process_time()
        llm.generate([prompt], params)
        return time.perf_counter() - t0, time.process_time() - c0

    run(args.decode_tokens)  # warm-up
    one, many = run(1), run(args.decode_tokens)
    out: dict = {
        "decode": (args.decode_tokens - 1) / (many[0] - one[0]),
        # per CPU-second of the process: what the rate would be on an otherwise idle core (1 thread)
        "decode_cpu": (args.decode_tokens - 1) / (many[1] - one[1]),
        "peak_rss_mib": peak_rss_mib(),
    }
    if args.count:
        k = 8
        counts = []
        for n in (1, k + 1):
            with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
                run(n)
            counts.append(sum(1 for e in prof.events() if "::" in e.name))
        out["calls_per_step"] = (counts[1] - counts[0]) / k
    out["fused_layers"] = None if fused is None else sum(i is not None for i in fused.index)
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--dtype", default="float32")
    ap.add_argument("--quantization", choices=["int8", "int4"])
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--decode-tokens", type=int, default=64)
    ap.add_argument("--phase", choices=SIDES, help=argparse.SUPPRESS)
    ap.add_argument("--count", action="store_true", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.phase:
        print(json.dumps(phase(args)))
        return
    repo = str(Path(__file__).resolve().parent.parent)
    counted: set[str] = set()

    def measure(side: str) -> dict:
        env = {**os.environ, "PYTHONPATH": os.environ.get("PYTHONPATH", repo), "OMP_NUM_THREADS": str(args.threads)}
        if side == "reference":
            env["PAGEDSERVE_FUSED_DECODE"] = "0"
        cmd = [sys.executable, __file__, f"--phase={side}", f"--dtype={args.dtype}", f"--threads={args.threads}"]
        cmd += [f"--decode-tokens={args.decode_tokens}"] + (["--count"] if side not in counted else [])
        cmd += [f"--quantization={args.quantization}"] if args.quantization else []
        counted.add(side)  # the call count does not vary: once per side
        proc = subprocess.run(cmd, capture_output=True, text=True, env=env, check=False)
        if proc.returncode != 0:
            sys.exit(f"{side} failed:\n{proc.stderr[-4000:]}")
        return json.loads(proc.stdout.strip().splitlines()[-1])

    paired = run_paired("reference", "fused", measure, metric="decode", rounds=args.rounds)
    report(args, paired)


def report(args, paired: PairedRounds) -> None:
    results = paired.runs
    fused, ref = results["fused"], results["reference"]
    cpu_ratios = [f["decode_cpu"] / r["decode_cpu"] for f, r in zip(fused, ref)]
    record = provenance(paired.loads)
    what = args.dtype + (f", {args.quantization} projections" if args.quantization else "")
    lines = [
        f"# Fused decode layers, batch-1 decode, SmolLM2-135M {what}",
        "",
        stamp(record),
        "",
        f"{args.threads} threads; {len(fused)} paired rounds (order alternating).",
        "",
        "| side | decode tok/s (median) | per round | tok per CPU-second (median) | dispatcher calls per decode step "
        "| fused layers | peak RSS MiB |",
        "| --- | --- | --- | --- | --- | --- | --- |",
    ]
    for side, rows in results.items():
        rates = " ".join(f"{o['decode']:.1f}" for o in rows)
        calls = next((o["calls_per_step"] for o in rows if "calls_per_step" in o), 0)
        lines.append(
            f"| {side} | {statistics.median(o['decode'] for o in rows):.1f} | "
            f"{rates} | {statistics.median(o['decode_cpu'] for o in rows):.1f} | {calls:.0f} | "
            f"{rows[0]['fused_layers']} | {max(o['peak_rss_mib'] for o in rows):.0f} |"
        )
    lines += [
        "",
        f"fused / reference per round (wall clock): {' '.join(f'{x:.2f}' for x in paired.ratios)}; "
        f"median {paired.ratio_median:.2f}",
        f"fused / reference per round (per CPU-second): {' '.join(f'{x:.2f}' for x in cpu_ratios)}; "
        f"median {statistics.median(cpu_ratios):.2f}",
    ]
    name = f"fused_decode_{args.dtype}" + (f"_{args.quantization}" if args.quantization else "")
    summary = {**record, **paired.summary(), "cpu_ratios": cpu_ratios}
    result_path(name, "json").write_text(json.dumps(summary, indent=1))
    result_path(name, "md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
