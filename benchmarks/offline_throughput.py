"""Offline throughput: this engine vs Hugging Face transformers batched generate, one run.

Workload (issue 2): 64 prompts of about 200 tokens, 128 output tokens each, EOS ignored,
bfloat16, 2 threads, the default model. Latency (issue 14), engine vs transformers: batch-1
decode tokens/s (a 32-token prompt, `--decode-tokens` generated; the rate is (N - 1) /
(time(N tokens) - time(1 token)), so prefill is excluded) and time to first token of a
1,000-token prompt (median of 3 distinct prompts per child). Also: prefix caching on vs off at a
0 % hit rate, and time to first token of a 1,000-token prompt with and without a cached
900-token prefix.

Method (issue 14): each measurement runs in a fresh child process (so each reports its own peak
RSS and none inherits another's allocator state). A round runs the engine, transformers and the
engine without prefix caching once each, the order reversed every other round; each ratio is
taken within a round (paired), every round's ratios are printed, and the result is the median
of the per-round ratios over at least 5 rounds, never the best round. TTFT: the median of 5
paired cold / cached trials. Results go to benchmarks/results/<name>.{json,md}.

`--profile` instead runs the engine once on the workload with timers around its parts and
prints where a step's time goes (schedule / prepare inputs / forward: matmul, attention, rest /
logits / sample / output processing / detokenize; see step_profile.py), written to
benchmarks/results/<name>_profile.md. Without it no timer is attached.

    .venv/bin/python benchmarks/offline_throughput.py [--num-prompts 64] [--output-len 128]
        [--rounds 5] [--name offline_throughput] [--profile]
"""

from __future__ import annotations

import argparse
import json
import math
import os
import sys
import time
from dataclasses import replace
from pathlib import Path
from statistics import median

from _common import RESULTS, make_prompts, peak_rss_mib, result_path, run_phase

from pagedserve.server.commands.bench.harness import (
    MIN_ROUNDS,
    PairedRounds,
    alternating_rounds,
    median_call_s,
    provenance,
    stamp,
)

TTFT_TRIALS = 5


def phase_engine(args, prompts, caching: bool, profile: bool = False) -> dict:
    from pagedserve.engine import LLM, SamplingParams

    # KV budget: 64 x (200 + 128) tokens need ~1,350 blocks of 16 (368 KiB each in bf16).
    llm = LLM(
        args.model,
        dtype=args.dtype,
        num_threads=2,
        kv_cache_memory="640MiB",
        max_num_seqs=len(prompts),
        max_num_batched_tokens=2048,
        enable_prefix_caching=caching,
    )
    params = SamplingParams(max_tokens=args.output_len, ignore_eos=True, temperature=0)
    llm.generate([prompts[0][:16]], SamplingParams(max_tokens=2, temperature=0))  # warm-up
    if profile:
        from step_profile import StepProfile

        timers = StepProfile().attach(llm)
    else:
        bookkeeping = _time_calls(llm.engine.scheduler, ("schedule", "update_from_output"))
    start = time.perf_counter()
    outs = llm.generate(prompts, params)
    elapsed = time.perf_counter() - start
    if profile:
        timers.detach()
    n_out = sum(len(o.outputs[0].token_ids) for o in outs)
    result = {
        "elapsed_s": elapsed,
        "output_tokens": n_out,
        "tok_per_s": n_out / elapsed,
        "hit_rate": llm.engine.kv_manager.prefix_cache_hit_rate,
        "peak_rss_mib": peak_rss_mib(),
    }
    if profile:
        return result | {"steps": timers.steps, "breakdown_s": timers.breakdown(elapsed)}
    return result | {"scheduler_kv_s": bookkeeping[0]}


def _time_calls(obj, names) -> list[float]:
    """Wrap obj's methods to add their wall time into the returned one-element list.

    The scheduler and the KV cache manager are where prefix caching does its work (hashing,
    lookups, publishing blocks); their time with caching on vs off is its exact cost, free of
    the run-to-run noise of whole-run throughput on a shared machine.
    """
    total = [0.0]
    for name in names:
        method = getattr(obj, name)

        def timed(*args, _method=method, **kwargs):
            start = time.perf_counter()
            try:
                return _method(*args, **kwargs)
            finally:
                total[0] += time.perf_counter() - start

        setattr(obj, name, timed)
    return total


def phase_hf(args, prompts) -> dict:
    import torch
    from transformers import AutoModelForCausalLM

    torch.set_num_threads(2)
    model = AutoModelForCausalLM.from_pretrained(args.model, dtype=torch.bfloat16)
    model.eval()
    pad = 0
    max_len = max(len(p) for p in prompts)
    ids = torch.tensor([[pad] * (max_len - len(p)) + p for p in prompts])
    mask = torch.tensor([[0] * (max_len - len(p)) + [1] * len(p) for p in prompts])
    with torch.inference_mode():
        model.generate(ids[:1, :16], attention_mask=mask[:1, :16], max_new_tokens=2, do_sample=False, pad_token_id=pad)
        start = time.perf_counter()
        out = model.generate(
            ids,
            attention_mask=mask,
            max_new_tokens=args.output_len,
            min_new_tokens=args.output_len,
            do_sample=False,
            pad_token_id=pad,
        )
        elapsed = time.perf_counter() - start
    n_out = (out.shape[1] - max_len) * out.shape[0]
    return {"elapsed_s": elapsed, "output_tokens": n_out, "tok_per_s": n_out / elapsed, "peak_rss_mib": peak_rss_mib()}


LATENCY_TTFT_PROMPTS = 3


def _latency(args, tokenizer, generate) -> dict:
    """Batch-1 decode rate and 1,000-token TTFT of `generate(prompt_ids, max_new_tokens)`."""
    short = make_prompts(tokenizer, 1, 32, seed=3000)[0]
    generate(short, 2)  # warm-up
    t0 = time.perf_counter()
    generate(short, 1)
    t1 = time.perf_counter()
    generate(short, args.decode_tokens)
    t2 = time.perf_counter()
    decode = (args.decode_tokens - 1) / ((t2 - t1) - (t1 - t0))
    ttfts = []
    for i in range(LATENCY_TTFT_PROMPTS):
        prompt = make_prompts(tokenizer, 1, 1000, seed=4000 + i)[0]
        start = time.perf_counter()
        generate(prompt, 1)
        ttfts.append(time.perf_counter() - start)
    return {
        "decode_tok_per_s": decode,
        "ttft_1000_s": median(ttfts),
        "ttft_trials_s": ttfts,
        "peak_rss_mib": peak_rss_mib(),
    }


def phase_latency_engine(args, tokenizer) -> dict:
    from pagedserve.engine import LLM, SamplingParams

    # Prefix caching off: every TTFT prompt is computed in full, as transformers does.
    llm = LLM(
        args.model,
        dtype="bfloat16",
        num_threads=2,
        kv_cache_memory="256MiB",
        max_num_batched_tokens=2048,
        enable_prefix_caching=False,
    )

    def generate(prompt, n):
        llm.generate([prompt], SamplingParams(max_tokens=n, ignore_eos=True, temperature=0))

    return _latency(args, tokenizer, generate)


def phase_latency_hf(args, tokenizer) -> dict:
    import torch
    from transformers import AutoModelForCausalLM

    torch.set_num_threads(2)
    model = AutoModelForCausalLM.from_pretrained(args.model, dtype=torch.bfloat16)
    model.eval()

    def generate(prompt, n):
        with torch.inference_mode():
            ids = torch.tensor([prompt])
            model.generate(
                ids,
                attention_mask=torch.ones_like(ids),
                max_new_tokens=n,
                min_new_tokens=n,
                do_sample=False,
                pad_token_id=0,
            )

    return _latency(args, tokenizer, generate)


def phase_floor(args) -> dict:
    """The batch-1 decode floor of this machine: bytes a decode step must read (the bf16 weights,
    the tied LM head once) over the memory read bandwidth (2 threads summing a 1 GiB tensor that
    no cache holds, median of 5)."""
    import torch
    from safetensors import safe_open

    from pagedserve.engine.model.loader import safetensors_files

    torch.set_num_threads(2)
    numel = 0
    for path in safetensors_files(args.model):
        with safe_open(str(path), "pt") as f:
            numel += sum(math.prod(f.get_slice(name).get_shape()) for name in f.keys())
    big = torch.ones(1 << 28, dtype=torch.float32)  # 1 GiB
    bandwidth = big.numel() * 4 / median_call_s(big.sum, 5)
    weight_bytes = 2 * numel
    return {
        "read_gb_per_s": bandwidth / 1e9,
        "bf16_weight_bytes": weight_bytes,
        "batch1_floor_ms": 1000 * weight_bytes / bandwidth,
    }


def phase_ttft(args, tokenizer) -> dict:
    from pagedserve.engine import LLM, SamplingParams

    llm = LLM(args.model, dtype="bfloat16", num_threads=2, kv_cache_memory="1GiB", max_num_batched_tokens=2048)
    one = SamplingParams(max_tokens=1, temperature=0)
    llm.generate([list(range(100, 116))], one)  # warm-up
    results = {}
    for trial in range(TTFT_TRIALS):
        base = make_prompts(tokenizer, 1, 1000, seed=1000 + trial)[0]
        other = make_prompts(tokenizer, 1, 100, seed=2000 + trial)[0]
        start = time.perf_counter()
        llm.generate([base], one)
        cold = time.perf_counter() - start
        start = time.perf_counter()
        llm.generate([base[:900] + other], one)  # shares a 900-token prefix with `base`
        warm = time.perf_counter() - start
        results.setdefault("cold_s", []).append(cold)
        results.setdefault("cached_900_s", []).append(warm)
    return {
        "ttft_cold_s": median(results["cold_s"]),
        "ttft_cached_900_s": median(results["cached_900_s"]),
        # the harness's paired ratio cold / cached (a prefix is computed cold before it is cached)
        "speedup": PairedRounds(
            "cached",
            "cold",
            "s",
            runs={k: [{"s": t} for t in results[f"{v}_s"]] for k, v in (("cold", "cold"), ("cached", "cached_900"))},
        ).ratio_median,
        "trials": results,
        "peak_rss_mib": peak_rss_mib(),
    }


def run_child(args, phase: str) -> dict:
    result = run_phase(
        __file__,
        [
            "--phase",
            phase,
            "--model",
            args.model,
            "--num-prompts",
            str(args.num_prompts),
            "--prompt-len",
            str(args.prompt_len),
            "--output-len",
            str(args.output_len),
            "--decode-tokens",
            str(args.decode_tokens),
            "--dtype",
            args.dtype,
        ],
    )
    print(f"  {phase}: {result}", flush=True)
    return result


def paired_rounds(args) -> tuple[dict[str, list[dict]], list[float]]:
    """`args.rounds` rounds of the five phases, the order reversed every other round; the
    load average after each round."""
    phases = ("engine", "hf", "engine_nocache", "latency_engine", "latency_hf")
    loads: list[float] = []

    def show(r: int, order: tuple[str, ...], runs: dict[str, list[dict]]) -> None:
        loads.append(os.getloadavg()[0])
        engine, hf, nocache = (runs[p][-1]["tok_per_s"] for p in phases[:3])
        lat_e, lat_h = runs["latency_engine"][-1], runs["latency_hf"][-1]
        print(
            f"  round {r + 1}/{args.rounds} ({', '.join(order)}): engine / transformers {engine / hf:.2f}x, "
            f"caching on / off {engine / nocache:.3f}, batch-1 decode "
            f"{lat_e['decode_tok_per_s'] / lat_h['decode_tok_per_s']:.2f}x, TTFT "
            f"{lat_e['ttft_1000_s'] / lat_h['ttft_1000_s']:.2f}x of transformers'",
            flush=True,
        )

    # the shared harness (pagedserve.server.commands.bench.harness)
    return alternating_rounds(phases, lambda phase: run_child(args, phase), args.rounds, on_round=show), loads


def summarize(args, runs: dict[str, list[dict]], ttft: dict, loads: list[float]) -> dict:
    # The harness's paired rounds of each comparison (candidate / baseline per round, their median).
    throughput = PairedRounds("hf", "engine", "tok_per_s", runs=runs)
    caching = PairedRounds("engine_nocache", "engine", "tok_per_s", runs=runs)
    decode = PairedRounds("latency_hf", "latency_engine", "decode_tok_per_s", runs=runs)
    ttft_1000 = replace(decode, metric="ttft_1000_s")
    bookkeeping = [
        (e["scheduler_kv_s"] - n["scheduler_kv_s"]) / e["elapsed_s"]
        for e, n in zip(runs["engine"], runs["engine_nocache"])
    ]
    return {
        "workload": {
            "num_prompts": args.num_prompts,
            "prompt_len": args.prompt_len,
            "output_len": args.output_len,
            "dtype": "bfloat16",
            "threads": 2,
        },
        **provenance(loads),
        "date": time.strftime("%Y-%m-%d %H:%M"),
        "rounds": args.rounds,
        "engine_tok_per_s_median": throughput.side_median("engine"),
        "hf_tok_per_s_median": throughput.side_median("hf"),
        "engine_vs_hf": throughput.ratio_median,
        "engine_vs_hf_per_round": throughput.ratios,
        # Noisy: whole-run throughput with caching on vs off (different processes).
        "batch1_decode_tok_per_s_median": {
            "engine": decode.side_median("latency_engine"),
            "hf": decode.side_median("latency_hf"),
        },
        "batch1_decode_vs_hf": decode.ratio_median,
        "batch1_decode_vs_hf_per_round": decode.ratios,
        "ttft_1000_s_median": {
            "engine": ttft_1000.side_median("latency_engine"),
            "hf": ttft_1000.side_median("latency_hf"),
        },
        "ttft_1000_vs_hf": ttft_1000.ratio_median,
        "ttft_1000_vs_hf_per_round": ttft_1000.ratios,
        "prefix_caching_cost_end_to_end": 1 - caching.ratio_median,
        "caching_on_vs_off_per_round": caching.ratios,
        # Exact: extra scheduler + KV-manager time with caching on, as a share of the run.
        "prefix_caching_cost_bookkeeping": median(bookkeeping),
        "ttft": ttft,
        "peak_rss_mib": {k: max(x["peak_rss_mib"] for x in v) for k, v in runs.items()}
        | {"ttft": ttft["peak_rss_mib"]},
        "runs": runs,
    }


def write_results(args, summary: dict) -> None:
    ttft = summary["ttft"]
    md = [
        "# Offline throughput (latest run)",
        "",
        stamp(summary),
        "",
        (
            f"{args.num_prompts} prompts x {args.prompt_len} tokens, {args.output_len} output tokens, bf16, "
            f"2 threads; median of {args.rounds} paired rounds (engine, transformers and the engine without "
            "prefix caching once each per round, fresh processes, the order reversed every other round)."
        ),
        "",
        "| measure | value |",
        "| --- | --- |",
        f"| engine (median) | {summary['engine_tok_per_s_median']:.1f} tok/s |",
        f"| transformers generate (median) | {summary['hf_tok_per_s_median']:.1f} tok/s |",
        f"| **engine / transformers, median of the per-round ratios** | **{summary['engine_vs_hf']:.2f}x** |",
        "| per-round ratios | " + ", ".join(f"{r:.2f}" for r in summary["engine_vs_hf_per_round"]) + " |",
        (
            f"| batch-1 decode, engine / transformers (median of per-round ratios; {args.decode_tokens} tokens) | "
            f"**{summary['batch1_decode_vs_hf']:.2f}x** ({summary['batch1_decode_tok_per_s_median']['engine']:.1f} vs "
            f"{summary['batch1_decode_tok_per_s_median']['hf']:.1f} tok/s) |"
        ),
        "| per-round ratios | " + ", ".join(f"{r:.2f}" for r in summary["batch1_decode_vs_hf_per_round"]) + " |",
        (
            f"| batch-1 decode floor: bf16 weight bytes / memory read bandwidth | "
            f"{summary['batch1_floor']['batch1_floor_ms']:.1f} ms per token "
            f"({summary['batch1_floor']['bf16_weight_bytes'] / 2**20:.0f} MiB at "
            f"{summary['batch1_floor']['read_gb_per_s']:.1f} GB/s; the engine's median: "
            f"{1000 / summary['batch1_decode_tok_per_s_median']['engine']:.1f} ms, transformers' "
            f"{1000 / summary['batch1_decode_tok_per_s_median']['hf']:.1f} ms) |"
        ),
        (
            f"| TTFT of a 1,000-token prompt, engine / transformers (median of per-round ratios; lower is better) | "
            f"**{summary['ttft_1000_vs_hf']:.2f}x** ({1000 * summary['ttft_1000_s_median']['engine']:.0f} vs "
            f"{1000 * summary['ttft_1000_s_median']['hf']:.0f} ms) |"
        ),
        "| per-round ratios | " + ", ".join(f"{r:.2f}" for r in summary["ttft_1000_vs_hf_per_round"]) + " |",
        f"| prefix caching cost at 0 % hits: extra scheduler + KV-manager time | {100 * summary['prefix_caching_cost_bookkeeping']:.2f} % of the run |",
        f"| same, whole-run throughput on vs off (median of per-round ratios; noisy) | {100 * summary['prefix_caching_cost_end_to_end']:+.1f} % |",
        f"| TTFT 1,000-token prompt, cold (median of {TTFT_TRIALS}) | {1000 * ttft['ttft_cold_s']:.0f} ms |",
        f"| TTFT with a cached 900-token prefix (median) | {1000 * ttft['ttft_cached_900_s']:.0f} ms ({ttft['speedup']:.1f}x faster, median of paired trials) |",
        "| peak RSS (MiB) | " + ", ".join(f"{k} {v:.0f}" for k, v in summary["peak_rss_mib"].items()) + " |",
        "",
        f"Run on {summary['date']}.",
    ]
    RESULTS.mkdir(exist_ok=True)
    result_path(f"{args.name}", "json").write_text(json.dumps(summary, indent=2) + "\n")
    result_path(f"{args.name}", "md").write_text("\n".join(md) + "\n")
    print("\n".join(md))


def run_profile(args) -> None:
    from step_profile import profile_page

    md = profile_page(run_child(args, "profile"), args)
    RESULTS.mkdir(exist_ok=True)
    result_path(f"{args.name}_profile", "md").write_text("\n".join(md) + "\n")
    print("\n".join(md))


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--model", default=None)
    parser.add_argument("--num-prompts", type=int, default=64)
    parser.add_argument("--prompt-len", type=int, default=200)
    parser.add_argument("--output-len", type=int, default=128)
    parser.add_argument("--decode-tokens", type=int, default=64, help="batch-1 decode length")
    parser.add_argument(
        "--dtype",
        default="bfloat16",
        choices=("bfloat16", "float32"),
        help="the engine's dtype in the throughput and profile phases (transformers and TTFT stay bf16)",
    )
    parser.add_argument("--phase", default=None, help=argparse.SUPPRESS)
    parser.add_argument(
        "--rounds",
        type=int,
        default=MIN_ROUNDS,
        help=f"paired rounds (at least {MIN_ROUNDS}); the result is their median",
    )
    parser.add_argument("--name", default="offline_throughput", help="results file name (no suffix)")
    parser.add_argument(
        "--profile", action="store_true", help="one engine run with the step breakdown instead of the comparison"
    )
    args = parser.parse_args()
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
    if args.model is None:
        from pagedserve.engine.model.default_model import default_model_dir

        args.model = str(default_model_dir())
    if args.phase:
        from transformers import AutoTokenizer

        tokenizer = AutoTokenizer.from_pretrained(args.model)
        prompts = make_prompts(tokenizer, args.num_prompts, args.prompt_len, seed=0)
        result = {
            "engine": lambda: phase_engine(args, prompts, caching=True),
            "engine_nocache": lambda: phase_engine(args, prompts, caching=False),
            "profile": lambda: phase_engine(args, prompts, caching=True, profile=True),
            "hf": lambda: phase_hf(args, prompts),
            "ttft": lambda: phase_ttft(args, tokenizer),
            "latency_engine": lambda: phase_latency_engine(args, tokenizer),
            "latency_hf": lambda: phase_latency_hf(args, tokenizer),
            "floor": lambda: phase_floor(args),
        }[args.phase]()
        print(json.dumps(result))
        return
    if args.profile:
        run_profile(args)
        return
    if args.rounds < MIN_ROUNDS:
        parser.error(f"--rounds must be at least {MIN_ROUNDS} (the result is a median of paired rounds)")
    runs, loads = paired_rounds(args)
    ttft = run_child(args, "ttft")
    summary = summarize(args, runs, ttft, loads)
    summary["batch1_floor"] = run_child(args, "floor")
    write_results(args, summary)


if __name__ == "__main__":
    main()
