"""Offline throughput: this engine vs Hugging Face transformers batched generate, one run.

Workload (issue 2): 64 prompts of about 200 tokens, 128 output tokens each, EOS ignored,
bfloat16, 2 threads, the default model. Also: prefix caching on vs off at a 0 % hit rate, and
time to first token of a 1,000-token prompt with and without a cached 900-token prefix.

Each measurement runs in a fresh child process (so each reports its own peak RSS and none
inherits another's allocator state); phases alternate where a ratio is taken. Results go to
benchmarks/results/offline_throughput.{json,md}.

    .venv/bin/python benchmarks/offline_throughput.py [--num-prompts 64] [--output-len 128]
"""

from __future__ import annotations

import argparse
import json
import platform
import sys
import time
from pathlib import Path

from _common import RESULTS, make_prompts, peak_rss_mib, run_phase


def phase_engine(args, prompts, caching: bool) -> dict:
    from engine import LLM, SamplingParams

    # KV budget: 64 x (200 + 128) tokens need ~1,350 blocks of 16 (368 KiB each in bf16).
    llm = LLM(args.model, dtype="bfloat16", num_threads=2, kv_cache_memory="640MiB",
              max_num_seqs=len(prompts), max_num_batched_tokens=2048, enable_prefix_caching=caching)
    params = SamplingParams(max_tokens=args.output_len, ignore_eos=True, temperature=0)
    llm.generate([prompts[0][:16]], SamplingParams(max_tokens=2, temperature=0))  # warm-up
    bookkeeping = _time_calls(llm.engine.scheduler, ("schedule", "update_from_output"))
    start = time.perf_counter()
    outs = llm.generate(prompts, params)
    elapsed = time.perf_counter() - start
    n_out = sum(len(o.outputs[0].token_ids) for o in outs)
    return {"elapsed_s": elapsed, "output_tokens": n_out, "tok_per_s": n_out / elapsed,
            "scheduler_kv_s": bookkeeping[0],
            "hit_rate": llm.engine.kv_manager.prefix_cache_hit_rate, "peak_rss_mib": peak_rss_mib()}


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
        out = model.generate(ids, attention_mask=mask, max_new_tokens=args.output_len,
                             min_new_tokens=args.output_len, do_sample=False, pad_token_id=pad)
        elapsed = time.perf_counter() - start
    n_out = (out.shape[1] - max_len) * out.shape[0]
    return {"elapsed_s": elapsed, "output_tokens": n_out, "tok_per_s": n_out / elapsed, "peak_rss_mib": peak_rss_mib()}


def phase_ttft(args, tokenizer) -> dict:
    from engine import LLM, SamplingParams

    llm = LLM(args.model, dtype="bfloat16", num_threads=2, kv_cache_memory="1GiB", max_num_batched_tokens=2048)
    one = SamplingParams(max_tokens=1, temperature=0)
    llm.generate([list(range(100, 116))], one)  # warm-up
    results = {}
    for trial in range(3):
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
    cold, warm = min(results["cold_s"]), min(results["cached_900_s"])
    return {"ttft_cold_s": cold, "ttft_cached_900_s": warm, "speedup": cold / warm, "peak_rss_mib": peak_rss_mib()}


def run_child(args, phase: str) -> dict:
    result = run_phase(__file__, ["--phase", phase, "--model", args.model, "--num-prompts", str(args.num_prompts),
                                  "--prompt-len", str(args.prompt_len), "--output-len", str(args.output_len)])
    print(f"  {phase}: {result}", flush=True)
    return result


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--model", default=None)
    parser.add_argument("--num-prompts", type=int, default=64)
    parser.add_argument("--prompt-len", type=int, default=200)
    parser.add_argument("--output-len", type=int, default=128)
    parser.add_argument("--phase", default=None, help=argparse.SUPPRESS)
    parser.add_argument("--rounds", type=int, default=2, help="alternating rounds of each phase")
    args = parser.parse_args()
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
    if args.model is None:
        from engine.model.default_model import default_model_dir

        args.model = str(default_model_dir())
    if args.phase:
        from transformers import AutoTokenizer

        tokenizer = AutoTokenizer.from_pretrained(args.model)
        prompts = make_prompts(tokenizer, args.num_prompts, args.prompt_len, seed=0)
        result = {
            "engine": lambda: phase_engine(args, prompts, caching=True),
            "engine_nocache": lambda: phase_engine(args, prompts, caching=False),
            "hf": lambda: phase_hf(args, prompts),
            "ttft": lambda: phase_ttft(args, tokenizer),
        }[args.phase]()
        print(json.dumps(result))
        return

    runs: dict[str, list[dict]] = {"engine": [], "engine_nocache": [], "hf": []}
    for r in range(args.rounds):
        print(f"round {r + 1}/{args.rounds}", flush=True)
        for phase in ("engine", "hf", "engine_nocache"):
            runs[phase].append(run_child(args, phase))
    ttft = run_child(args, "ttft")
    best = {k: max(v, key=lambda x: x["tok_per_s"]) for k, v in runs.items()}
    summary = {
        "workload": {"num_prompts": args.num_prompts, "prompt_len": args.prompt_len,
                     "output_len": args.output_len, "dtype": "bfloat16", "threads": 2},
        "machine": {"platform": platform.platform(), "processor": platform.processor()},
        "date": time.strftime("%Y-%m-%d %H:%M"),
        "engine_tok_per_s": best["engine"]["tok_per_s"],
        "hf_tok_per_s": best["hf"]["tok_per_s"],
        "engine_vs_hf": best["engine"]["tok_per_s"] / best["hf"]["tok_per_s"],
        # Noisy: whole-run throughput with caching on vs off (different processes).
        "prefix_caching_cost_end_to_end": 1 - best["engine"]["tok_per_s"] / best["engine_nocache"]["tok_per_s"],
        # Exact: extra scheduler + KV-manager time with caching on, as a share of the run.
        "prefix_caching_cost_bookkeeping": (
            min(r["scheduler_kv_s"] for r in runs["engine"]) - min(r["scheduler_kv_s"] for r in runs["engine_nocache"])
        ) / best["engine"]["elapsed_s"],
        "ttft": ttft,
        "peak_rss_mib": {k: max(x["peak_rss_mib"] for x in v) for k, v in runs.items()} | {"ttft": ttft["peak_rss_mib"]},
        "runs": runs,
    }
    RESULTS.mkdir(exist_ok=True)
    (RESULTS / "offline_throughput.json").write_text(json.dumps(summary, indent=2) + "\n")
    md = [
        "# Offline throughput (latest run)", "",
        f"{args.num_prompts} prompts x {args.prompt_len} tokens, {args.output_len} output tokens, bf16, 2 threads; best of {args.rounds} alternating rounds.", "",
        "| measure | value |", "| --- | --- |",
        f"| engine | {summary['engine_tok_per_s']:.1f} tok/s |",
        f"| transformers generate | {summary['hf_tok_per_s']:.1f} tok/s |",
        f"| **engine / transformers** | **{summary['engine_vs_hf']:.2f}x** |",
        f"| prefix caching cost at 0 % hits: extra scheduler + KV-manager time | {100 * summary['prefix_caching_cost_bookkeeping']:.2f} % of the run |",
        f"| same, whole-run throughput on vs off (noisy, separate processes) | {100 * summary['prefix_caching_cost_end_to_end']:+.1f} % |",
        f"| TTFT 1,000-token prompt, cold | {1000 * ttft['ttft_cold_s']:.0f} ms |",
        f"| TTFT with a cached 900-token prefix | {1000 * ttft['ttft_cached_900_s']:.0f} ms ({ttft['speedup']:.1f}x faster) |",
        "| peak RSS (MiB) | " + ", ".join(f"{k} {v:.0f}" for k, v in summary["peak_rss_mib"].items()) + " |",
        "", f"Run on {summary['date']} ({summary['machine']['platform']}).",
    ]
    (RESULTS / "offline_throughput.md").write_text("\n".join(md) + "\n")
    print("\n".join(md))


if __name__ == "__main__":
    main()
