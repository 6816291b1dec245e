"""Quantized modes vs bf16 on the default model, paired rounds in one run.

Measurements (issue 12). Each round runs every mode in a fresh child process that loads the
engine once and takes every measurement, reporting its own memory:
- decode: batch-1 decode tokens/s (a 32-token prompt, `--decode-tokens` generated; the rate is
  (N - 1) / (time(N tokens) - time(1 token)), so prefill is excluded);
- ttft: time to first token of a `--ttft-len`-token prompt (prefix caching off);
- batch: `--batch-prompts` prompts of 200 tokens -> `--batch-output` tokens, output tokens/s;
- sweep: decode output tokens/s at each batch size of `--sweep` (that many 32-token prompts,
  `--decode-tokens` tokens each, all decoding together; prefill excluded as for `decode`);
- memory: resident set after loading (VmRSS, the checkpoint's memory map already closed) and
  peak (VmHWM) over the child's run; the bf16 weight bytes are counted from the model.
The order of the modes rotates every round; a mode's ratio is the median over rounds of
(mode / bf16 of the same round).

    PYTHONPATH=. .venv/bin/python benchmarks/quantized.py [--rounds 5] [--modes int8,int4,w8a8,fp8kv]

Mode `fp8kv` is bf16 weights with `kv_cache_dtype: fp8_e4m3` (the batch phase's 640 MiB KV
budget then holds ~1.9x the blocks).

`--isa avx2` runs every mode as on an AVX2-only CPU (Zen 3, Haswell..): the native kernels'
AVX2 path and the engine's AVX2 choices (`PAGEDSERVE_CPU_ISA=avx2`), torch's own kernels at
their AVX2 level (`ATEN_CPU_CAPABILITY=avx2`) and oneDNN's GEMMs without AVX-512 or AMX
(`ONEDNN_MAX_CPU_ISA=AVX2`); the results file is then `quantized_avx2`.

Writes benchmarks/results/quantized[_avx2].<cpu-kind>.{json,md}.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import statistics
import sys
import time

from _common import RESULTS, make_prompts, peak_rss_mib, provenance, result_path, run_phase, stamp

from pagedserve.server.commands.bench.harness import alternating_rounds, rss_mib

# What an AVX2-only CPU runs: the native kernels, torch's kernels and oneDNN each capped at AVX2.
AVX2_ENV = {"PAGEDSERVE_CPU_ISA": "avx2", "ATEN_CPU_CAPABILITY": "avx2", "ONEDNN_MAX_CPU_ISA": "AVX2"}


def _checkpoint_numel(model_dir) -> int:
    from safetensors import safe_open

    from pagedserve.engine.model.loader import safetensors_files

    total = 0
    for path in safetensors_files(model_dir):
        with safe_open(str(path), "pt") as f:
            for name in f.keys():
                shape = f.get_slice(name).get_shape()
                total += math.prod(shape)
    return total


def _llm(args, mode: str, **opts):
    from pagedserve.engine import LLM
    from pagedserve.engine.model.default_model import default_model_dir

    if mode == "fp8kv":  # bf16 weights, fp8 KV cache (kv_cache_dtype fp8_e4m3)
        return LLM(default_model_dir(), dtype="bfloat16", num_threads=args.threads, kv_cache_dtype="fp8_e4m3", **opts)
    quant = None if mode == "bf16" else mode
    return LLM(default_model_dir(), dtype="bfloat16", num_threads=args.threads, quantization=quant, **opts)


def phase(args) -> dict:
    """One mode, in this (fresh) process: load once, then every measurement of `args.phases`."""
    from pagedserve.engine import SamplingParams

    # Prefix caching off: the TTFT prompt and the batch's prompts are computed in full.
    llm = _llm(
        args,
        args.mode,
        kv_cache_memory="640MiB",
        max_num_seqs=max(args.batch_prompts, *_sweep(args), 1),
        max_num_batched_tokens=2048,
        max_model_len=2048,
        enable_prefix_caching=False,
    )
    out = {"rss_after_load_mib": rss_mib(os.getpid()), "model_bytes": 2 * _checkpoint_numel(llm.engine.model_dir)}
    phases = args.phases.split(",")
    if "decode" in phases:
        prompt = make_prompts(llm.tokenizer, 1, 32, seed=1)[0]
        one = SamplingParams(max_tokens=1, ignore_eos=True, temperature=0)
        many = SamplingParams(max_tokens=args.decode_tokens, ignore_eos=True, temperature=0)
        llm.generate([prompt], many)  # warm-up
        t0 = time.perf_counter()
        llm.generate([prompt], one)
        t1 = time.perf_counter()
        llm.generate([prompt], many)
        t2 = time.perf_counter()
        out["decode"] = (args.decode_tokens - 1) / ((t2 - t1) - (t1 - t0))
    if "ttft" in phases:
        prompts = make_prompts(llm.tokenizer, 2, args.ttft_len, seed=2)
        one = SamplingParams(max_tokens=1, temperature=0)
        llm.generate([prompts[0]], one)  # warm-up at the same length
        t0 = time.perf_counter()
        llm.generate([prompts[1]], one)
        out["ttft"] = time.perf_counter() - t0
    if "batch" in phases:
        prompts = make_prompts(llm.tokenizer, args.batch_prompts, 200, seed=3)
        params = SamplingParams(max_tokens=args.batch_output, ignore_eos=True, temperature=0)
        t0 = time.perf_counter()
        outs = llm.generate(prompts, params)
        elapsed = time.perf_counter() - t0
        out["batch"] = sum(len(o.outputs[0].token_ids) for o in outs) / elapsed
    if "sweep" in phases:
        prompts = make_prompts(llm.tokenizer, max(_sweep(args)), 32, seed=4)
        one = SamplingParams(max_tokens=1, ignore_eos=True, temperature=0)
        many = SamplingParams(max_tokens=args.decode_tokens, ignore_eos=True, temperature=0)
        for n in _sweep(args):
            llm.generate(prompts[:n], one)  # warm-up at this batch size
            t0 = time.perf_counter()
            llm.generate(prompts[:n], one)
            t1 = time.perf_counter()
            llm.generate(prompts[:n], many)
            t2 = time.perf_counter()
            out[f"sweep{n}"] = n * (args.decode_tokens - 1) / ((t2 - t1) - (t1 - t0))
    return out | {"peak_rss_mib": peak_rss_mib()}


def _sweep(args) -> list[int]:
    return [int(n) for n in args.sweep.split(",") if n] if "sweep" in args.phases.split(",") else []


def _measures(args) -> list[str]:
    """The measured quantities, in report order: the phases, the sweep one per batch size."""
    out = [p for p in args.phases.split(",") if p and p != "sweep"]
    return out + [f"sweep{n}" for n in _sweep(args)]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--modes", default="int8,int4,w8a8,fp8kv")
    ap.add_argument("--phases", default="decode,ttft,batch")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--decode-tokens", type=int, default=64)
    ap.add_argument("--ttft-len", type=int, default=1000)
    ap.add_argument("--batch-prompts", type=int, default=64)
    ap.add_argument("--batch-output", type=int, default=128)
    ap.add_argument("--sweep", default="1,4,16,64", help="batch sizes of the sweep phase")
    ap.add_argument("--isa", choices=["native", "avx2"], default="native", help="avx2: run as an AVX2-only CPU")
    ap.add_argument("--phase", help=argparse.SUPPRESS)
    ap.add_argument("--mode", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.phase:
        print(json.dumps(phase(args)))
        return
    if args.isa == "avx2":
        os.environ.update(AVX2_ENV)  # the children inherit it
    modes = ["bf16", *[m for m in args.modes.split(",") if m]]
    passthrough = [
        f"--threads={args.threads}",
        f"--decode-tokens={args.decode_tokens}",
        f"--ttft-len={args.ttft_len}",
        f"--batch-prompts={args.batch_prompts}",
        f"--batch-output={args.batch_output}",
        f"--sweep={args.sweep}",
    ]
    loads: list[float] = []

    def measure(mode: str) -> dict:
        out = run_phase(__file__, ["--phase=all", f"--mode={mode}", f"--phases={args.phases}", *passthrough])
        print(
            f"{mode:5s} "
            + " ".join(f"{k} {out[k]:.3f}" for k in _measures(args))
            + f" rss {out['rss_after_load_mib']:.0f} peak {out['peak_rss_mib']:.0f} MiB",
            file=sys.stderr,
            flush=True,
        )
        return out

    def done(r: int, order: tuple[str, ...], results: dict[str, list[dict]]) -> None:
        loads.append(os.getloadavg()[0])
        report(args, modes, results, loads)  # a stopped run still leaves its rounds

    alternating_rounds(modes, measure, args.rounds, on_round=done)


def report(args, modes: list[str], results: dict, loads: list[float]) -> None:
    higher_better = {"decode": True, "ttft": False, "batch": True}
    units = {"decode": "tok/s", "ttft": "s", "batch": "tok/s"}
    rounds = len(results[modes[-1]])
    record = provenance(loads)
    name = "quantized" if args.isa == "native" else f"quantized_{args.isa}"
    summary: dict = {**record, "isa": args.isa, "args": vars(args), "rounds": rounds}
    forced = " Every mode ran as on an AVX2-only CPU (" + ", ".join(f"{k}={v}" for k, v in AVX2_ENV.items()) + ")."
    lines = [
        f"# Quantized modes vs bf16 (default model{', AVX2 path forced' if args.isa == 'avx2' else ''})",
        "",
        stamp(record),
        "",
        f"{args.threads} threads, {rounds} rounds (every mode once per round, the order reversed every other "
        "round; each mode in a fresh process), median of per-round ratios to bf16 (>1 = faster; TTFT: bf16 "
        "time / mode time)." + (forced if args.isa == "avx2" else ""),
        "",
        "| measure | mode | median | ratio vs bf16 | per-round ratios |",
        "| --- | --- | --- | --- | --- |",
    ]
    for measure in _measures(args):
        label = (
            f"decode at batch {measure[5:]} (tok/s)" if measure.startswith("sweep") else f"{measure} ({units[measure]})"
        )
        base = [o[measure] for o in results["bf16"][:rounds]]
        for mode in modes:
            vals = [o[measure] for o in results[mode][:rounds]]
            ratios = [(v / b if higher_better.get(measure, True) else b / v) for v, b in zip(vals, base)]
            entry = {"median": statistics.median(vals), "ratio": statistics.median(ratios), "ratios": ratios}
            summary.setdefault(measure, {})[mode] = entry
            lines.append(
                f"| {label} | {mode} | {entry['median']:.3f} | {entry['ratio']:.2f}x | "
                f"{', '.join(f'{x:.2f}' for x in ratios)} |"
            )
    bf_rss = statistics.median(o["rss_after_load_mib"] for o in results["bf16"])
    weights_mib = results["bf16"][0]["model_bytes"] / 2**20
    lines += [
        "",
        f"Worker memory (RSS once loaded, before any request; peak over the run, which includes the "
        f"640 MiB KV pool's use; the model's weights in bf16 are {weights_mib:.0f} MiB):",
        "",
        "| mode | RSS after load MiB | saved vs bf16 MiB | saved / bf16 weight bytes | peak RSS MiB |",
        "| --- | --- | --- | --- | --- |",
    ]
    for mode in modes:
        rss = statistics.median(o["rss_after_load_mib"] for o in results[mode])
        peak = max(o["peak_rss_mib"] for o in results[mode])
        summary.setdefault("memory", {})[mode] = {
            "rss_after_load_mib": rss,
            "peak_rss_mib": peak,
            "saved_fraction_of_bf16_weights": (bf_rss - rss) / weights_mib,
        }
        lines.append(
            f"| {mode} | {rss:.0f} | {bf_rss - rss:.0f} | {100 * (bf_rss - rss) / weights_mib:.0f} % | {peak:.0f} |"
        )
    lines += [
        "",
        f"Workloads: batch-1 decode of {args.decode_tokens} tokens after a 32-token prompt; TTFT of a "
        f"{args.ttft_len}-token prompt; {args.batch_prompts} prompts x 200 tokens -> {args.batch_output} "
        f"tokens; the sweep decodes {args.decode_tokens} tokens for each of that many 32-token prompts at once.",
    ]
    RESULTS.mkdir(exist_ok=True)
    result_path(name, "json").write_text(json.dumps(summary, indent=2) + "\n")
    result_path(name, "md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
