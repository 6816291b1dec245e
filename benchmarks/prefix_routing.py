"""Prefix-affinity routing vs least-loaded on a multi-turn chat workload, 2 workers, one run.

One fresh `pagedserve serve` process serves the default model twice, from two archives that
differ only in their model-config `routing` key: model `ll` (least_loaded) and model `pa`
(prefix_affinity), each with 2 workers (bf16, one torch thread each). A phase runs the same
kind of workload against one of them: `--conversations` chats at once, each `--turns` turns
long; a chat's first user message is a document of about `--doc-words` random words (its own,
new in every phase, so no phase profits from an earlier one's cache), each later turn appends
the assistant's reply and a short question, and a chat sends its next turn when the last reply
arrived (plus, with `--think-s`, a random pause of up to that many seconds, seeded: without it
the chats' turns arrive in lock-step, and least-loaded's turn-taking can keep sending a chat to
the same worker by accident). Replies are `--max-tokens` tokens (greedy, EOS ignored) over
`POST /v1/chat/completions`.

Per phase: the prefix-cache hit rate (prompt tokens the workers served from their prefix cache,
`usage.prompt_tokens_details.cached_tokens` / `timings.cached_prompt_tokens`, over all prompt
tokens, and over the follow-up turns alone, whose prefix was computed before), total tokens
(prompt + output) per second of wall time, and the mean request latency. The phases alternate
for `--rounds` rounds, the order flipping every round; the headline is the median of the
per-round paired ratios (pa / ll). The load generator shares the machine with the server.
Results go to benchmarks/results/prefix_routing.<cpu-kind>.{json,md}.

    .venv/bin/python benchmarks/prefix_routing.py [--rounds 5] [--conversations 8] [--turns 4]
"""

from __future__ import annotations

import argparse
import asyncio
import itertools
import json
import random
import statistics
import subprocess
import tempfile
import time
import urllib.request
from dataclasses import replace
from pathlib import Path

from _common import RESULTS, result_path, stop_server
from _common import start_server as common_start_server

from pagedserve.server.commands.bench.harness import MIN_ROUNDS, provenance, run_paired, stamp

REPO = Path(__file__).resolve().parent.parent
POLICIES = {"ll": "least_loaded", "pa": "prefix_affinity"}


def write_store(store: Path, args) -> None:
    import yaml

    from pagedserve.engine.model.archive import write_archive
    from pagedserve.engine.model.default_model import default_model_dir

    store.mkdir(parents=True)
    for name, routing in POLICIES.items():
        config = store.parent / f"{name}-model-config.yaml"
        config.write_text(
            yaml.safe_dump(
                {
                    "minWorkers": 2,
                    "maxWorkers": 2,
                    "routing": routing,
                    "startupTimeout": 900,
                    "handler": {"dtype": "bfloat16", "kv_cache_memory": args.kv_cache_memory, "max_model_len": 2048},
                }
            )
        )
        written = write_archive(
            default_model_dir(), store.parent / f"build-{name}", model_name=name, version="1.0", config_file=config
        )
        written.rename(store / f"{name}.mar")


def start_server(workdir: Path) -> tuple[subprocess.Popen, str, str]:
    proc, urls = common_start_server(workdir, [f"{n}={n}.mar" for n in POLICIES], timeout=1200)
    return proc, urls["inference"], urls["metrics"]


def words(seed: int, n: int) -> str:
    rng = random.Random(seed)
    vocab = [
        "river",
        "stone",
        "market",
        "engine",
        "cloud",
        "garden",
        "letter",
        "winter",
        "signal",
        "harbor",
        "pencil",
        "forest",
        "copper",
        "ladder",
        "candle",
        "meadow",
        "rocket",
        "violin",
        "tunnel",
        "basket",
        "mirror",
        "planet",
        "orchard",
        "lantern",
        "canvas",
        "thunder",
    ]
    return " ".join(rng.choice(vocab) for _ in range(n))


async def conversation(session, base: str, model: str, seed: int, args) -> list[dict]:
    messages = [{"role": "user", "content": f"Read this and answer questions about it: {words(seed, args.doc_words)}"}]
    turns = []
    pause = random.Random(seed)
    for turn in range(args.turns):
        if turn and args.think_s:  # a user reads the reply before the next question
            await asyncio.sleep(pause.uniform(0, args.think_s))
        body = {
            "model": model,
            "messages": messages,
            "max_tokens": args.max_tokens,
            "temperature": 0,
            "ignore_eos": True,
        }
        t0 = time.monotonic()
        async with session.post(f"{base}/v1/chat/completions", json=body) as resp:
            data = await resp.json()
            if resp.status != 200:
                raise RuntimeError(f"{resp.status}: {data}")
        reply = data["choices"][0]["message"]["content"]
        turns.append(
            {
                "turn": turn,
                "latency_s": time.monotonic() - t0,
                "prompt_tokens": data["usage"]["prompt_tokens"],
                "completion_tokens": data["usage"]["completion_tokens"],
                "cached_tokens": data["timings"]["cached_prompt_tokens"],
            }
        )
        messages += [
            {"role": "assistant", "content": reply},
            {"role": "user", "content": f"Question {turn}: {words(seed * 31 + turn, 12)}?"},
        ]
    return turns


async def phase(base: str, model: str, seed: int, args) -> dict:
    import aiohttp

    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=1800)) as session:
        t0 = time.monotonic()
        chats = await asyncio.gather(
            *(conversation(session, base, model, seed * 1000 + c, args) for c in range(args.conversations))
        )
        wall = time.monotonic() - t0
    turns = [t for chat in chats for t in chat]
    later = [t for t in turns if t["turn"] > 0]
    prompt = sum(t["prompt_tokens"] for t in turns)
    out = sum(t["completion_tokens"] for t in turns)
    return {
        "model": model,
        "routing": POLICIES[model],
        "wall_s": wall,
        "requests": len(turns),
        "prompt_tokens": prompt,
        "completion_tokens": out,
        "hit_rate": sum(t["cached_tokens"] for t in turns) / prompt,
        "hit_rate_followups": (
            sum(t["cached_tokens"] for t in later) / sum(t["prompt_tokens"] for t in later) if later else 0.0
        ),
        "tok_per_s": (prompt + out) / wall,
        "req_per_s": len(turns) / wall,
        "mean_latency_s": statistics.fmean(t["latency_s"] for t in turns),
    }


def route_hits(metrics_url: str) -> dict[str, float]:
    with urllib.request.urlopen(metrics_url + "/metrics", timeout=30) as r:
        text = r.read().decode()
    return {
        line.split("{", 1)[1].split("}")[0]: float(line.rsplit(" ", 1)[1])
        for line in text.splitlines()
        if line.startswith("pagedserve_route_prefix_hits_total{")
    }


def write_results(result: dict) -> None:
    RESULTS.mkdir(exist_ok=True)
    result_path("prefix_routing", "json").write_text(json.dumps(result, indent=2) + "\n")
    s = result["summary"]
    lines = [
        "# Prefix-affinity routing vs least-loaded (2 workers, multi-turn chat)",
        "",
        stamp(result),
        "",
        f"{result['settings']}",
        "",
        "| round | policy | hit rate (all) | hit rate (follow-ups) | tokens/s | req/s | mean latency s |",
        "| --- | --- | --- | --- | --- | --- | --- |",
    ]
    for i, rnd in enumerate(result["rounds"]):
        for r in rnd:
            lines.append(
                f"| {i} | {r['routing']} | {r['hit_rate']:.3f} | {r['hit_rate_followups']:.3f} | "
                f"{r['tok_per_s']:.1f} | {r['req_per_s']:.2f} | {r['mean_latency_s']:.2f} |"
            )
    lines += [
        "",
        f"Median of per-round paired ratios (prefix_affinity / least_loaded): throughput "
        f"{s['tok_per_s_ratio_median']:.2f}x, mean latency {s['latency_ratio_median']:.2f}x; "
        f"hit rate {s['hit_rate_ll_median']:.3f} -> {s['hit_rate_pa_median']:.3f} "
        f"(follow-ups {s['followup_hit_rate_ll_median']:.3f} -> {s['followup_hit_rate_pa_median']:.3f}).",
        "",
        f"Router prefix hits per worker at the end: `{json.dumps(result['route_prefix_hits'])}`",
        "",
        "Figures are rough on a shared machine; the ratios are paired per round.",
    ]
    result_path("prefix_routing", "md").write_text("\n".join(lines) + "\n")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rounds", type=int, default=MIN_ROUNDS)
    ap.add_argument("--conversations", type=int, default=8)
    ap.add_argument("--turns", type=int, default=4)
    ap.add_argument("--doc-words", type=int, default=300)
    ap.add_argument("--max-tokens", type=int, default=16)
    ap.add_argument("--kv-cache-memory", default="256MiB")
    ap.add_argument(
        "--think-s",
        type=float,
        default=0.0,
        help="each follow-up waits a random 0..think-s seconds (seeded) after the reply",
    )
    args = ap.parse_args()
    with tempfile.TemporaryDirectory(prefix="prefix-routing-") as tmp:
        workdir = Path(tmp)
        write_store(workdir / "store", args)
        proc, base, metrics = start_server(workdir)
        try:
            asyncio.run(
                phase(base, "ll", 1, argparse.Namespace(**{**vars(args), "conversations": 2, "turns": 1}))
            )  # warm-up
            asyncio.run(phase(base, "pa", 2, argparse.Namespace(**{**vars(args), "conversations": 2, "turns": 1})))
            seeds = itertools.count(100)  # every phase its own new documents
            paired = run_paired(
                "ll",
                "pa",
                lambda m: asyncio.run(phase(base, m, next(seeds), args)),
                metric="tok_per_s",
                rounds=args.rounds,
            )
            hits = route_hits(metrics)
        finally:
            stop_server(proc, timeout=120)
    latency = replace(paired, metric="mean_latency_s")
    summary = {
        "tok_per_s_ratio_median": paired.ratio_median,
        "latency_ratio_median": latency.ratio_median,
        "hit_rate_ll_median": replace(paired, metric="hit_rate").side_median("ll"),
        "hit_rate_pa_median": replace(paired, metric="hit_rate").side_median("pa"),
        "followup_hit_rate_ll_median": replace(paired, metric="hit_rate_followups").side_median("ll"),
        "followup_hit_rate_pa_median": replace(paired, metric="hit_rate_followups").side_median("pa"),
    }
    result = {
        "settings": {k: v for k, v in vars(args).items()},
        "rounds": [sorted(pair, key=lambda r: r["model"]) for pair in zip(paired.runs["ll"], paired.runs["pa"])],
        "summary": summary,
        "route_prefix_hits": hits,
        **provenance(paired.loads),
    }
    write_results(result)
    print(json.dumps(summary, indent=2))


if __name__ == "__main__":
    main()
