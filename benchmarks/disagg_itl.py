"""Disaggregated prefill/decode vs two `both` workers: short chats' inter-token latency while
long prompts arrive, paired rounds.

One fresh `pagedserve serve` process serves the default model (SmolLM2-135M, bf16, one torch
thread per worker) twice, from two archives that differ only in their model-config: model
`both` (2 workers that each prefill and decode, today's setup) and model `pd` (`workerRoles:
[prefill, decode]`, the KV handed over through LMCache's disk tier in a folder under /dev/shm
that both workers share). A phase drives one of them for `--seconds` with `--concurrency`
closed-loop clients: `--long-clients` of them send long prompts (`--long-tokens` tokens of
random words, new ones every request, so no prefix is reused) for `--long-max-tokens` tokens;
the others send short chats (~30-token prompts) for `--short-max-tokens` tokens, streamed. The
inter-token latency (ITL) of a short chat is the gap between its consecutive streamed chunks;
the phase reports its p50/p99 over every short chat that finished, and the long prompts' TTFT.
The sides run as the harness's alternating rounds (`--rounds`, the order flipping every round); the headline is the
median of the per-round ratios of short-chat p99 ITL (pd / both). The load generator shares the
machine with the server.

    .venv/bin/python benchmarks/disagg_itl.py [--rounds 5] [--seconds 25] [--long-tokens 4000]

Results: benchmarks/results/disagg_itl.<cpu-kind>.{json,md}.
"""

from __future__ import annotations

import argparse
import asyncio
import itertools
import json
import os
import random
import shutil
import statistics
import tempfile
import time
import urllib.request
from pathlib import Path

from _common import peak_rss_mib, result_path, stop_server
from _common import start_server as common_start_server

from pagedserve.server.commands.bench.harness import MIN_ROUNDS, PairedRounds, alternating_rounds, provenance, stamp

SIDES = ("both", "pd")


def write_store(store: Path, kv_dir: Path, args) -> None:
    import yaml

    from pagedserve.engine.model.archive import write_archive
    from pagedserve.engine.model.default_model import default_model_dir

    store.mkdir(parents=True)
    handler = {
        "dtype": "bfloat16",
        "kv_cache_memory": args.kv_cache_memory,
        "max_model_len": args.long_tokens + 256,
    }
    for name in SIDES:
        # responseTimeout: on an overloaded machine a long prompt queued behind another waits minutes.
        config: dict = {
            "minWorkers": 2,
            "maxWorkers": 2,
            "startupTimeout": 900,
            "responseTimeout": 3600,
            "handler": dict(handler),
        }
        if name == "pd":
            config["workerRoles"] = ["prefill", "decode"]
            config["handler"]["kv_offload"] = {
                "disk_path": str(kv_dir),
                "disk_size_gb": 4,
                "cpu_size_gb": 0.5,
                "chunk_size": 256,
            }
        path = store.parent / f"{name}-model-config.yaml"
        path.write_text(yaml.safe_dump(config))
        written = write_archive(
            default_model_dir(), store.parent / f"build-{name}", model_name=name, version="1.0", config_file=path
        )
        written.rename(store / f"{name}.mar")


def random_words(rng: random.Random, n: int) -> str:
    letters = "abcdefghijklmnopqrstuvwxyz"
    return " ".join("".join(rng.choice(letters) for _ in range(rng.randint(3, 7))) for _ in range(n))


async def stream_one(session, base: str, body: dict) -> tuple[float, list[float], dict]:
    """One streamed completion: (TTFT, gaps between chunks, the final timings record)."""
    t0 = time.monotonic()
    times: list[float] = []
    timings: dict = {}
    async with session.post(f"{base}/v1/completions", json={**body, "stream": True}) as resp:
        if resp.status != 200:
            raise RuntimeError(f"{resp.status}: {await resp.text()}")
        async for raw in resp.content:
            line = raw.decode().strip()
            if not line.startswith("data: {"):
                continue
            event = json.loads(line[6:])
            if event.get("timings"):
                timings = event["timings"]
            if event.get("choices") and event["choices"][0].get("text"):
                times.append(time.monotonic())
    if not times:
        raise RuntimeError("no tokens streamed")
    return times[0] - t0, [b - a for a, b in zip(times, times[1:])], timings


async def client(session, base: str, model: str, kind: str, seed: int, deadline: float, args, out: dict) -> None:
    rng = random.Random(seed)
    await asyncio.sleep(rng.uniform(0, args.stagger_s))  # arrivals spread out, not in lock-step
    while time.monotonic() < deadline:
        if kind == "long":  # token ids: exactly --long-tokens of them, new ones every request
            prompt = [rng.randrange(1000, 40000) for _ in range(args.long_tokens)]
            body = {"model": model, "prompt": prompt, "max_tokens": args.long_max_tokens}
        else:
            prompt = f"User {seed}: tell me about {random_words(rng, 12)}. Assistant:"
            body = {"model": model, "prompt": prompt, "max_tokens": args.short_max_tokens}
        body.update(temperature=0, ignore_eos=True)
        ttft, gaps, timings = await stream_one(session, base, body)
        out[kind].append({"ttft_s": ttft, "gaps": gaps, "timings": timings})


async def phase(base: str, model: str, seed: int, args) -> dict:
    import aiohttp

    out: dict = {"long": [], "short": []}
    deadline = time.monotonic() + args.seconds
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=1800)) as session:
        await asyncio.gather(
            *(
                client(
                    session,
                    base,
                    model,
                    "long" if c < args.long_clients else "short",
                    seed * 100 + c,
                    deadline,
                    args,
                    out,
                )
                for c in range(args.concurrency)
            )
        )
    gaps = sorted(g for r in out["short"] for g in r["gaps"])
    if not gaps:
        raise RuntimeError("no short chat finished")
    paths: dict[str, int] = {}
    for r in out["long"]:
        d = r["timings"].get("disagg") or {}
        key = "/".join(str(d.get(k)) for k in ("path", "reason") if d.get(k)) or "none"
        paths[key] = paths.get(key, 0) + 1
    longs = out["long"]
    return {
        "model": model,
        "short_requests": len(out["short"]),
        "long_requests": len(longs),
        "short_itl_p50_s": statistics.median(gaps),
        "short_itl_p99_s": gaps[min(len(gaps) - 1, int(0.99 * len(gaps)))],
        "short_itl_max_s": gaps[-1],
        "long_ttft_mean_s": statistics.fmean(r["ttft_s"] for r in longs) if longs else None,
        "long_paths": paths,
        "long_phases_mean_s": _phases(longs),
    }


def _phases(longs: list[dict]) -> dict | None:
    ds = [r["timings"]["disagg"] for r in longs if (r["timings"].get("disagg") or {}).get("path") == "disaggregated"]
    if not ds:
        return None
    keys = ("queue_s", "prefill_s", "transfer_s", "first_decode_s")
    out = {k: statistics.fmean(d[k] for d in ds) for k in keys}
    out["transfer_mb"] = statistics.fmean(d["transfer_bytes"] for d in ds) / 1e6
    return out


def tree_peak_rss_mib(pid: int) -> float:
    """Peak RSS of the server process plus its worker processes (sum of each one's peak)."""
    total = peak_rss_mib(pid)
    children = Path(f"/proc/{pid}/task/{pid}/children")
    for child in children.read_text().split() if children.exists() else []:
        try:
            total += tree_peak_rss_mib(int(child))
        except (OSError, ValueError):
            pass
    return total


def metric_lines(metrics_url: str, prefix: str) -> list[str]:
    with urllib.request.urlopen(metrics_url + "/metrics", timeout=30) as r:
        return [ln for ln in r.read().decode().splitlines() if ln.startswith(prefix)]


def write_results(result: dict) -> None:
    path = result_path("disagg_itl", "json")
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(result, indent=2) + "\n")
    a = result["args"]
    lines = [
        "# Disaggregated prefill/decode vs two `both` workers: short chats' p99 inter-token latency",
        "",
        stamp(result),
        "",
        f"{len(result['rounds'])} of {a['rounds']} paired rounds.",
        "",
        f"SmolLM2-135M bf16, 2 workers per side, 1 torch thread each; {a['concurrency']} closed-loop clients for "
        f"{a['seconds']} s per phase: {a['long_clients']} send ~{a['long_tokens']}-token prompts "
        f"({a['long_max_tokens']} tokens out), the others short chats ({a['short_max_tokens']} tokens out, streamed). "
        "`pd`: workerRoles [prefill, decode], KV through LMCache's disk tier on /dev/shm.",
        "",
        "| round | order | both p99 ITL (s) | pd p99 ITL (s) | ratio pd/both | both p50 | pd p50 | both long TTFT | pd long TTFT |",
        "| --- | --- | --- | --- | --- | --- | --- | --- | --- |",
    ]
    for r in result["rounds"]:
        b, p = r["both"], r["pd"]
        lines.append(
            f"| {r['round']} | {r['order']} | {b['short_itl_p99_s']:.3f} | {p['short_itl_p99_s']:.3f} | "
            f"{r['ratio_p99']:.2f} | {b['short_itl_p50_s']:.3f} | {p['short_itl_p50_s']:.3f} | "
            f"{_f(b['long_ttft_mean_s'])} | {_f(p['long_ttft_mean_s'])} |"
        )
    met = "met" if result["median_ratio_p99"] <= 0.5 else "NOT met"
    lines += [
        "",
        f"**Median paired ratio of short-chat p99 ITL (pd / both): {result['median_ratio_p99']:.2f}** "
        f"(the bar is <= 0.5: {met}).",
        "",
        f"Long prompts' TTFT phases on `pd` (mean over disaggregated requests, last round): "
        f"{json.dumps(result['rounds'][-1]['pd']['long_phases_mean_s'])}; paths: "
        f"{json.dumps(result['rounds'][-1]['pd']['long_paths'])}.",
        f"Peak resident memory: server + 4 workers {result['peak_rss_mib']:.0f} MiB.",
        "",
        "Disaggregation metrics at the end:",
        "",
        "```",
        *result["disagg_metrics"],
        "```",
    ]
    result_path("disagg_itl", "md").write_text("\n".join(lines) + "\n")


def _f(x: float | None) -> str:
    return "-" if x is None else f"{x:.2f}"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=MIN_ROUNDS)
    parser.add_argument("--seconds", type=float, default=25.0)
    parser.add_argument("--concurrency", type=int, default=16)
    parser.add_argument("--long-clients", type=int, default=2)
    parser.add_argument("--long-tokens", type=int, default=4000)
    parser.add_argument("--long-max-tokens", type=int, default=4)
    parser.add_argument("--short-max-tokens", type=int, default=24)
    parser.add_argument("--kv-cache-memory", default="512MiB")
    parser.add_argument("--stagger-s", type=float, default=5.0, help="clients start within this many seconds")
    args = parser.parse_args()
    # A 2,048-token prefill step can take tens of seconds on a shared, overloaded 2-core machine:
    # the default 30 s heartbeat would take such a worker for stalled and kill it.
    os.environ.setdefault("PAGEDSERVE_WORKER_HEARTBEAT_TIMEOUT", "600")
    work = Path(tempfile.mkdtemp(prefix="disagg-bench-"))
    kv_dir = Path(tempfile.mkdtemp(prefix="disagg-kv-", dir="/dev/shm"))
    write_store(work / "store", kv_dir, args)
    proc, urls = common_start_server(work, [f"{n}={n}.mar" for n in SIDES], timeout=1800)
    try:
        calls = itertools.count()  # round k's side gets the seed 1000 k + its index
        orders: list[str] = []
        loads: list[float] = []

        def measure(side: str) -> dict:
            seed = 1000 * (next(calls) // len(SIDES)) + SIDES.index(side)
            res = asyncio.run(phase(urls["inference"], side, seed=seed, args=args))
            print(f"{side}: {json.dumps(res)}", flush=True)
            return res

        def done(k: int, order: tuple[str, ...], runs: dict[str, list[dict]]) -> None:
            orders.append("/".join(order))
            loads.append(os.getloadavg()[0])
            paired = PairedRounds("both", "pd", "short_itl_p99_s", runs=runs)  # pd / both per round
            print(f"round {k}: p99 ITL ratio pd/both = {paired.ratios[-1]:.3f}", flush=True)
            rounds = [
                {"round": i, "order": o, "ratio_p99": ratio, "both": b, "pd": d}
                for i, (o, ratio, b, d) in enumerate(zip(orders, paired.ratios, runs["both"], runs["pd"]))
            ]
            write_results(  # after every round: a run cut short still leaves its rounds
                {
                    **provenance(loads),
                    "args": vars(args),
                    "rounds": rounds,
                    "median_ratio_p99": paired.ratio_median,
                    "peak_rss_mib": tree_peak_rss_mib(proc.pid),
                    "disagg_metrics": [
                        ln for ln in metric_lines(urls["metrics"], "pagedserve_disagg_") if "_bucket" not in ln
                    ],
                }
            )
            if k == args.rounds - 1:
                print(f"median paired ratio (pd/both) of short chats' p99 ITL: {paired.ratio_median:.3f} (bar <= 0.5)")

        alternating_rounds(SIDES, measure, args.rounds, on_round=done)
    finally:
        stop_server(proc)
        shutil.copy(work / "server.log", Path(tempfile.gettempdir()) / "disagg_itl-server.log")
        shutil.rmtree(kv_dir, ignore_errors=True)
        shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    main()
