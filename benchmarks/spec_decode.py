"""Speculative decoding (n-gram prompt lookup) vs plain decoding, greedy, on the default model.

Two workloads, each at batch 1 and batch 8: "edit" asks the model to repeat a paragraph with a
small change (the output copies the prompt: drafts are often right), "chat" asks open questions
(drafts are rarely right: this is what speculation costs when it does not pay). Each phase runs
in a fresh child process; the phases alternate for `--rounds` rounds, the order flipping every
round, and the median of the per-round ratios is reported. Throughput is output tokens / wall
time of `LLM.chat` over the workload; peak RSS per phase; acceptance = drafts kept / drafts.
Results go to benchmarks/results/spec_decode.<cpu-kind>.{json,md}.

    .venv/bin/python benchmarks/spec_decode.py [--rounds 3] [--k 4]
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import sys
import time
from pathlib import Path

from _common import RESULTS, peak_rss_mib, result_path, run_phase

REPO = Path(__file__).resolve().parent.parent
PARAGRAPH = ("The library opens at nine in the morning and closes at six in the evening. Members may borrow "
             "up to five books at a time for three weeks. Late returns cost ten cents per day. The reading "
             "room on the second floor is quiet and has free wireless internet.")
WORKLOADS = {
    "edit": [f"Repeat this text exactly, but replace '{a}' with '{b}':\n\n{PARAGRAPH}"
             for a, b in [("nine", "eight"), ("six", "seven"), ("five", "four"), ("three", "two"),
                          ("ten", "twenty"), ("second", "third"), ("morning", "day"), ("books", "items")]],
    "chat": ["Why is the sky blue?", "Give me three tips for better sleep.", "What is a prime number?",
             "Describe a cat in two sentences.", "How do plants make food?", "What causes rain?",
             "Name some uses of copper.", "Why do we have seasons?"],
}


def phase(args) -> dict:
    sys.path.insert(0, str(REPO))
    from engine import LLM, SamplingParams
    from engine.model.default_model import default_model_dir

    speculative = None
    if args.phase == "spec":
        speculative = {"num_speculative_tokens": args.k, "prompt_lookup_min": args.min_n}
    llm = LLM(default_model_dir(), dtype="bfloat16", kv_cache_memory="512MiB", max_model_len=1024,
              num_threads=2, speculative=speculative)
    params = SamplingParams(max_tokens=args.max_tokens, temperature=0)
    llm.chat([[{"role": "user", "content": "Hi"}]], SamplingParams(max_tokens=4))  # warm-up
    conversations = [[{"role": "user", "content": p}] for p in WORKLOADS[args.workload][: args.batch]]
    before = llm.engine.make_stats()
    start = time.perf_counter()
    outs = llm.chat(conversations, params)
    elapsed = time.perf_counter() - start
    stats = llm.engine.make_stats()
    tokens = [o.outputs[0].token_ids for o in outs]
    drafts = stats.spec_draft_tokens - before.spec_draft_tokens
    return {"tok_per_s": sum(map(len, tokens)) / elapsed, "elapsed_s": elapsed, "tokens": tokens,
            "acceptance": (stats.spec_accepted_tokens - before.spec_accepted_tokens) / drafts if drafts else None,
            "peak_rss_mib": peak_rss_mib()}


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--k", type=int, default=4, help="num_speculative_tokens")
    parser.add_argument("--min-n", type=int, default=2, help="prompt_lookup_min")
    parser.add_argument("--max-tokens", type=int, default=128)
    parser.add_argument("--phase", default=None, help=argparse.SUPPRESS)
    parser.add_argument("--workload", default="edit", help=argparse.SUPPRESS)
    parser.add_argument("--batch", type=int, default=1, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.phase:
        print(json.dumps(phase(args)))
        return
    cases = [(w, b) for w in WORKLOADS for b in (1, 8)]
    runs = {f"{w}/{b}": {"plain": [], "spec": []} for w, b in cases}
    for r in range(args.rounds):
        for w, b in cases:
            for name in ("plain", "spec")[:: 1 if r % 2 == 0 else -1]:
                result = run_phase(__file__, ["--phase", name, "--workload", w, "--batch", str(b), "--k", str(args.k),
                                              "--min-n", str(args.min_n), "--max-tokens", str(args.max_tokens)])
                runs[f"{w}/{b}"][name].append(result)
                print(f"round {r + 1} {w} batch {b} {name}: {result['tok_per_s']:.1f} tok/s"
                      + (f", acceptance {result['acceptance']:.2f}" if result["acceptance"] is not None else ""),
                      flush=True)
    write_results(args, runs)


def write_results(args, runs: dict) -> None:
    rows, summary = [], {}
    for case, sides in runs.items():
        ratios = [s["tok_per_s"] / p["tok_per_s"] for p, s in zip(sides["plain"], sides["spec"])]
        same = all(p["tokens"] == s["tokens"] for p, s in zip(sides["plain"], sides["spec"]))
        plain = statistics.median(x["tok_per_s"] for x in sides["plain"])
        spec = statistics.median(x["tok_per_s"] for x in sides["spec"])
        acceptance = statistics.median(x["acceptance"] or 0.0 for x in sides["spec"])
        rss = max(x["peak_rss_mib"] for x in sides["plain"]), max(x["peak_rss_mib"] for x in sides["spec"])
        summary[case] = {"speedup_median": statistics.median(ratios), "speedup_per_round": ratios,
                         "plain_tok_per_s": plain, "spec_tok_per_s": spec, "acceptance": acceptance,
                         "same_tokens": same, "peak_rss_mib": {"plain": rss[0], "spec": rss[1]}}
        rows.append(f"| {case} | {plain:.1f} | {spec:.1f} | **{statistics.median(ratios):.2f}x** "
                    f"({', '.join(f'{x:.2f}' for x in ratios)}) | {acceptance:.2f} | {'yes' if same else 'no'} "
                    f"| {rss[0]:.0f} / {rss[1]:.0f} |")
    RESULTS.mkdir(exist_ok=True)
    result_path("spec_decode", "json").write_text(json.dumps(
        {"k": args.k, "prompt_lookup_min": args.min_n, "max_tokens": args.max_tokens, "rounds": args.rounds,
         "date": time.strftime("%Y-%m-%d %H:%M"),
         "platform": platform.platform(), "cases": summary}, indent=2) + "\n")
    md = ["# Speculative decoding (n-gram prompt lookup) vs plain decoding (latest run)", "",
          (f"Default model, bf16, 2 threads, greedy, up to {args.max_tokens} output tokens, "
           f"num_speculative_tokens={args.k}, prompt_lookup_min={args.min_n}; {args.rounds} rounds, the order "
           "flipping every round; throughput is the median over rounds, the speed-up the median of per-round "
           "ratios."), "",
          ("| workload / batch | plain tok/s | speculative tok/s | speed-up (per round) | acceptance | same tokens "
           "| peak RSS MiB plain / spec |"), "| --- | --- | --- | --- | --- | --- | --- |", *rows, "",
          f"Run on {time.strftime('%Y-%m-%d %H:%M')} ({platform.platform()})."]
    result_path("spec_decode", "md").write_text("\n".join(md) + "\n")
    print("\n".join(md))


if __name__ == "__main__":
    main()
