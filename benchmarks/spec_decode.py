"""Speculative decoding, each method vs plain decoding, on the default model (bf16).

Workloads: "chat" (open questions, sampled at temperature 0.8 with a seed: drafts rarely
right, so this is what speculation costs when it does not pay) at batch 1, 8 and 32; "edit"
(repeat a paragraph with one change, greedy: the output copies the prompt) at batch 1 and 8;
"agent" (a 10-turn loop at batch 1, greedy: each turn the model re-emits the same tool-call
JSON with a changed argument, the conversation growing turn by turn; one example exchange
opens it, without which the 135M model answers in prose). Methods: plain, ngram,
suffix, auto. Each round runs every method once, each in a fresh child process that runs
all workloads; the order of the methods flips every round. A method's speed-up for a
workload is the median over rounds of (its tok/s) / (plain's tok/s in the same round).
Throughput = output tokens / wall time, and / the process's CPU time (the engine runs on one
thread; on a shared machine CPU time is what the method changes); acceptance = drafts kept / drafts. The agent phase
prints the global suffix trie's size. Results: benchmarks/results/<out>.<cpu-kind>.{json,md}.

    .venv/bin/python benchmarks/spec_decode.py [--rounds 5] [--k 6]
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from dataclasses import replace
from pathlib import Path

from _common import RESULTS, result_path, run_phase

from pagedserve.server.commands.bench.harness import PairedRounds, alternating_rounds, provenance, stamp

REPO = Path(__file__).resolve().parent.parent
METHODS = ("plain", "ngram", "suffix", "auto")
PARAGRAPH = (
    "The library opens at nine in the morning and closes at six in the evening. Members may borrow "
    "up to five books at a time for three weeks. Late returns cost ten cents per day. The reading "
    "room on the second floor is quiet and has free wireless internet."
)
EDITS = [
    ("nine", "eight"),
    ("six", "seven"),
    ("five", "four"),
    ("three", "two"),
    ("ten", "twenty"),
    ("second", "third"),
    ("morning", "day"),
    ("books", "items"),
]
TOPICS = [
    "the sky",
    "sleep",
    "prime numbers",
    "cats",
    "plants",
    "rain",
    "copper",
    "seasons",
    "volcanoes",
    "bread",
    "the moon",
    "bees",
    "rivers",
    "chess",
    "music",
    "glass",
]
CHAT = [f"{q} {t}." for q in ("Tell me something about", "Write two sentences on") for t in TOPICS]
AGENT_SYSTEM = (
    'You are an agent. To use the weather tool reply with only this JSON: {"tool": "get_weather", '
    '"arguments": {"city": "<city>", "unit": "celsius", "days": 3}}'
)
CITIES = ["Paris", "Berlin", "Madrid", "Rome", "Vienna", "Oslo", "Lisbon", "Prague", "Dublin", "Warsaw"]
CASES = [("chat", 1), ("chat", 8), ("chat", 32), ("edit", 1), ("edit", 8), ("agent", 1)]


def phase(args) -> dict:
    sys.path.insert(0, str(REPO))
    from pagedserve.engine import LLM, SamplingParams
    from pagedserve.engine.model.default_model import default_model_dir

    speculative = None if args.phase == "plain" else {"method": args.phase, "num_speculative_tokens": args.k}
    if args.phase in ("suffix", "auto"):
        speculative["suffix_spec_factor"] = args.suffix_spec_factor
    llm = LLM(
        default_model_dir(),
        dtype="bfloat16",
        kv_cache_memory="768MiB",
        max_model_len=2048,
        num_threads=args.threads,
        speculative=speculative,
    )
    llm.chat([[{"role": "user", "content": "Hi"}]], SamplingParams(max_tokens=4))  # warm-up
    out = {}
    for case in args.cases.split(","):
        workload, batch = case.split("/")[0], int(case.split("/")[1])
        before = llm.engine.make_stats()
        start, cpu_start = time.perf_counter(), time.process_time()
        if workload == "agent":
            tokens = agent_loop(llm, SamplingParams(max_tokens=args.agent_tokens, temperature=0))
        else:
            if workload == "chat":
                prompts = CHAT[:batch]
                params = [
                    SamplingParams(max_tokens=args.max_tokens, temperature=0.8, top_p=0.95, seed=i)
                    for i in range(batch)
                ]
            else:
                prompts = [
                    f"Repeat this text exactly, but replace '{a}' with '{b}':\n\n{PARAGRAPH}" for a, b in EDITS[:batch]
                ]
                params = SamplingParams(max_tokens=args.max_tokens, temperature=0)
            outs = llm.chat([[{"role": "user", "content": p}] for p in prompts], params)
            tokens = [o.outputs[0].token_ids for o in outs]
        elapsed, cpu = time.perf_counter() - start, time.process_time() - cpu_start
        print(f"{args.phase} {workload}/{batch}: {elapsed:.1f} s", file=sys.stderr, flush=True)
        stats = llm.engine.make_stats()
        drafts = stats.spec_draft_tokens - before.spec_draft_tokens
        out[f"{workload}/{batch}"] = {
            "tok_per_s": sum(map(len, tokens)) / elapsed,
            "tokens": tokens,
            "tok_per_cpu_s": sum(map(len, tokens)) / cpu,
            "acceptance": (stats.spec_accepted_tokens - before.spec_accepted_tokens) / drafts if drafts else None,
            "drafted_steps": stats.spec_requests_drafted - before.spec_requests_drafted,
            "skipped_steps": stats.spec_requests_skipped - before.spec_requests_skipped,
            "suffix_global_tokens": stats.spec_suffix_global_tokens,
            "suffix_global_bytes": stats.spec_suffix_global_bytes,
        }
    return out


def agent_loop(llm, params) -> list[list[int]]:
    """10 turns: each asks for the tool call with another city; the model's replies stay in
    the conversation. The conversation opens with one example exchange (a call for London), so
    the small default model answers every turn with the tool-call JSON, the city changed."""
    example = '{"tool": "get_weather", "arguments": {"city": "London", "unit": "celsius", "days": 3}}'
    messages = [
        {"role": "system", "content": AGENT_SYSTEM},
        {"role": "user", "content": "What is the weather in London?"},
        {"role": "assistant", "content": example},
    ]
    tokens = []
    for turn, city in enumerate(CITIES):
        ask = f'Tool result: {{"ok": true, "turn": {turn}}}. Now the weather in {city}, same format.'
        messages.append({"role": "user", "content": ask})
        out = llm.chat([messages], params)[0].outputs[0]
        messages.append({"role": "assistant", "content": out.text})
        tokens.append(out.token_ids)
    return tokens


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--k", type=int, default=6, help="num_speculative_tokens")
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--methods", default=",".join(METHODS[1:]))
    parser.add_argument(
        "--plan",
        default=None,
        help="cases per method, e.g. 'auto:chat/1,edit/1;suffix:agent/1' (overrides --methods/--cases; "
        "plain runs every case named)",
    )
    parser.add_argument("--agent-tokens", type=int, default=40)
    parser.add_argument("--suffix-spec-factor", type=float, default=1.0, help="suffix_spec_factor")
    parser.add_argument("--threads", type=int, default=1, help="torch threads (1 on a busy machine)")
    parser.add_argument("--cases", default=",".join(f"{w}/{b}" for w, b in CASES))
    parser.add_argument("--phase", default=None, help=argparse.SUPPRESS)
    parser.add_argument("--out", default="spec_decode")
    args = parser.parse_args()
    if args.phase:
        print(json.dumps(phase(args)))
        return
    if args.plan:
        plan = {m: c for m, c in (part.split(":") for part in args.plan.split(";"))}
        plan = {"plain": ",".join(dict.fromkeys(c for cases in plan.values() for c in cases.split(","))), **plan}
    else:
        plan = {m: args.cases for m in ["plain", *args.methods.split(",")]}
    methods = list(plan)

    def measure(method: str) -> dict:
        result = run_phase(
            __file__,
            [
                "--phase",
                method,
                "--k",
                str(args.k),
                "--max-tokens",
                str(args.max_tokens),
                "--threads",
                str(args.threads),
                "--cases",
                plan[method],
                "--agent-tokens",
                str(args.agent_tokens),
                "--suffix-spec-factor",
                str(args.suffix_spec_factor),
            ],
        )
        print(
            f"{method}: "
            + ", ".join(
                f"{case} {v['tok_per_s']:.1f}"
                + (f" (acc {v['acceptance']:.2f})" if v["acceptance"] is not None else "")
                for case, v in result.items()
            ),
            flush=True,
        )
        return result

    def after(r: int, order: tuple[str, ...], runs: dict[str, list[dict]]) -> None:
        for method in methods[1:]:
            print(
                f"round {r + 1} ratios {method} (CPU time / wall): "
                + ", ".join(
                    f"{case} {runs[method][r][case]['tok_per_cpu_s'] / runs['plain'][r][case]['tok_per_cpu_s']:.2f}"
                    f" / {runs[method][r][case]['tok_per_s'] / runs['plain'][r][case]['tok_per_s']:.2f}"
                    for case in runs[method][r]
                ),
                flush=True,
            )
        write_results(args, methods, runs)  # after every round: a cut-short run keeps its rounds

    # the shared harness (pagedserve.server.commands.bench.harness): the order reversed every other round
    alternating_rounds(methods, measure, args.rounds, on_round=after)


def write_results(args, methods: list[str], runs: dict) -> None:
    summary, rows = {}, []
    for case in runs["plain"][0]:
        plain = [r[case] for r in runs["plain"]]
        for method in methods[1:]:
            if case not in runs[method][0]:
                continue
            spec = [r[case] for r in runs[method]]
            wall = PairedRounds("plain", method, "tok_per_s", runs={"plain": plain, method: spec})
            cpu = replace(wall, metric="tok_per_cpu_s")
            ratios, cpu_ratios = wall.ratios, cpu.ratios
            same = all(p["tokens"] == s["tokens"] for p, s in zip(plain, spec))
            acc = [s["acceptance"] for s in spec if s["acceptance"] is not None]
            drafted = sum(s["drafted_steps"] for s in spec)
            skipped = sum(s["skipped_steps"] for s in spec)
            summary[f"{case}/{method}"] = {
                "speedup_median": wall.ratio_median,
                "speedup_per_round": ratios,
                "cpu_speedup_median": cpu.ratio_median,
                "cpu_speedup_per_round": cpu_ratios,
                "plain_tok_per_s": wall.side_median("plain"),
                "tok_per_s": wall.side_median(method),
                "acceptance": statistics.median(acc) if acc else None,
                "same_tokens": same,
                "auto_drafted_share": drafted / (drafted + skipped) if drafted + skipped else None,
                "suffix_global_tokens": max(s["suffix_global_tokens"] for s in spec),
                "suffix_global_bytes": max(s["suffix_global_bytes"] for s in spec),
            }
            v = summary[f"{case}/{method}"]
            acc_text = "-" if v["acceptance"] is None else f"{v['acceptance']:.2f}"
            share = "-" if v["auto_drafted_share"] is None else f"{v['auto_drafted_share']:.2f}"
            rows.append(
                f"| {case} | {method} | {v['plain_tok_per_s']:.1f} | {v['tok_per_s']:.1f} | "
                f"**{v['cpu_speedup_median']:.2f}x** ({', '.join(f'{x:.2f}' for x in cpu_ratios)}) | "
                f"{v['speedup_median']:.2f}x ({', '.join(f'{x:.2f}' for x in ratios)}) | {acc_text} | {share} | "
                f"{'yes' if same else 'no'} |"
            )
    agent = [summary[f"agent/1/{m}"] for m in methods[1:] if f"agent/1/{m}" in summary and m in ("suffix", "auto")]
    memory = (
        (
            f"Global suffix trie after the agent loop (largest over rounds): "
            f"{agent[0]['suffix_global_tokens']} tokens, {agent[0]['suffix_global_bytes'] / 2**20:.2f} MiB "
            f"(upper bound; bound set by suffix_global_tokens=16384)"
        )
        if agent
        else ""
    )
    RESULTS.mkdir(exist_ok=True)
    meta = {
        "k": args.k,
        "max_tokens": args.max_tokens,
        "rounds": len(runs["plain"]),
        **provenance(),
        "date": time.strftime("%Y-%m-%d %H:%M"),
    }
    result_path(args.out, "json").write_text(json.dumps({**meta, "cases": summary}, indent=2) + "\n")
    md = [
        f"# Speculative decoding: each method vs plain decoding ({len(runs['plain'])} paired rounds)",
        "",
        stamp(meta),
        "",
        (
            f"Default model (SmolLM2-135M), bf16, {args.threads} thread(s), num_speculative_tokens={args.k}, up to "
            f"{args.max_tokens} output tokens (agent: {args.agent_tokens} per turn, 10 turns). chat: sampled (temperature 0.8, "
            "top_p 0.95, seeded); edit and agent: greedy. Each round runs every method in a fresh process, the "
            "order flipping every round; the speed-up is the median of the per-round ratios to plain decoding "
            "in the same round (per-round ratios in brackets), measured both as output tokens per second of the "
            "process's CPU time (the engine runs on 1 thread: on a machine shared with other jobs this is what "
            "the method changes) and per second of wall time (which also swings with the other jobs' load). "
            "auto share: decode steps of a request given "
            "drafts / all its decode steps. same tokens: greedy output identical to plain in every round "
            "(bf16: a different batch shape may round differently; sampled chat is not compared)."
        ),
        "",
        (
            "| workload / batch | method | plain tok/s | method tok/s | speed-up, CPU time (per round) | "
            "speed-up, wall time (per round) | acceptance | auto share | same tokens |"
        ),
        "| --- | --- | --- | --- | --- | --- | --- | --- | --- |",
        *rows,
        "",
        memory,
        "",
        f"Run on {meta['date']}.",
    ]
    result_path(args.out, "md").write_text("\n".join(md) + "\n")
    print("\n".join(md))


if __name__ == "__main__":
    main()
