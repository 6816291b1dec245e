"""Plain-request latency while issue 11's availability attacks run, against the same with none.

A fresh `pagedserve serve` on loopback (one 1-thread worker of the default model, bf16, max_model_len 2048,
token auth off, responseTimeout 20 s so a held request cannot outlive its round) serves a
plain client: one request at a time, `POST /predictions/bench` with a 4-token prompt and
`max_tokens: 4`, greedy; its latency is the wall time of the whole reply. Attacks (issue 11):

- `grammar` (finding 1): 4 clients, each keeping one /predictions request in flight whose JSON
  schema (as JSON text, about 20 KB) nests arrays 700 deep;
- `stops` (finding 2): 1 client keeping one streaming request in flight with 64 stop strings of
  1,024 characters (the most the request schema allows; the issue's 3,000 x 2,000 is now a 400:
  `--stop-count`, `--stop-len`), 256 tokens, EOS ignored, every stop string sharing the output's
  tail so the stream holds text back at every chunk;
- `bad_field` (finding 3): 100 clients, each sending `{"ignore_eos": "yes"}` (the worker used to
  drop it while the request held a queue slot until responseTimeout);
- `huge_prompt` (finding 4): 4 clients, each keeping one 6 MB prompt in flight;
- `long_stream` (a control, not an attack): the `stops` stream without stop strings, to tell
  what its stop strings cost from what sharing the worker with a 256-token stream costs.

An attack client sends its next request when the previous one is answered, at most one per
`--min-interval` seconds (per attack, see ATTACKS). Each attack in turn runs the harness's
paired rounds (pagedserve.server.commands.bench.harness.run_paired): a round measures the plain
latencies with no attack and with the attack running, in an order that flips every round; the
headline per attack is the median over rounds of the paired ratio (attack / no attack) of p50
and of p99, and the criterion is p99 within 2x. Plain requests that fail are counted (a 503
is a failed request, not a fast one). The front end's peak RSS (VmHWM) is reported at the end.
Loopback only; request counts and time are bounded (`--requests` per phase, `--rounds`).

    .venv/bin/python benchmarks/attack_latency.py [--rounds 5] [--requests 30] [--attacks grammar,stops,bad_field,huge_prompt]

Results go to benchmarks/results/attack_latency.<cpu-kind>.{json,md}.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import os
import subprocess
import tempfile
import time
from dataclasses import dataclass, replace
from pathlib import Path

from _common import RESULTS, result_path, stop_server
from _common import start_server as common_start_server

from pagedserve.server.commands.bench.harness import (
    MIN_ROUNDS,
    PairedRounds,
    peak_rss_mib,
    percentile,
    provenance,
    rss_mib,
    run_paired,
    stamp,
)

REPO = Path(__file__).resolve().parent.parent
MODEL_NAME = "bench"
PLAIN = {"prompt": "1, 2, 3, 4,", "max_tokens": 4, "temperature": 0}


@dataclass(frozen=True)
class Attack:
    clients: int
    min_interval_s: float  # an attack client sends at most one request per this many seconds
    stream: bool = False


# The attacks kept in flight, each client at a bounded rate (an unbounded flood of any
# request measures the machine's capacity, not a weakness): up to 8 deep schemas/s, one long
# stream at a time, up to 10 bad-field requests/s, up to 4 huge prompts (24 MB)/s.
ATTACKS = {
    "grammar": Attack(clients=4, min_interval_s=0.5),
    "stops": Attack(clients=1, min_interval_s=0.0, stream=True),
    "bad_field": Attack(clients=100, min_interval_s=10.0),
    "huge_prompt": Attack(clients=4, min_interval_s=1.0),
    # Control for `stops`: the same stream without stop strings (what sharing the worker costs).
    "long_stream": Attack(clients=1, min_interval_s=0.0, stream=True),
}


def attack_body(name: str, args) -> bytes:
    if name == "grammar":
        schema: dict = {"type": "integer"}
        for _ in range(700):
            schema = {"type": "array", "items": schema}
        body = {**PLAIN, "structured_outputs": {"json": json.dumps(schema)}}  # text: past the body's depth bound
    elif name == "stops":
        stop = [" " + "x" * (i % 7) + f"{i:05d}" + "y" * (args.stop_len - 6 - i % 7) for i in range(args.stop_count)]
        body = {"prompt": "Write a long story.", "max_tokens": 256, "ignore_eos": True, "stop": stop, "stream": True}
    elif name == "long_stream":
        body = {"prompt": "Write a long story.", "max_tokens": 256, "ignore_eos": True, "stream": True}
    elif name == "bad_field":
        body = {"prompt": "x", "max_tokens": 2, "ignore_eos": "yes"}
    elif name == "huge_prompt":
        body = {"prompt": "1, 2, 3, 4, " * 500_000, "max_tokens": 4}
    else:
        raise ValueError(f"unknown attack {name!r}")
    return json.dumps(body).encode()


async def plain_latencies(session, url: str, n: int) -> dict:
    latencies, failures = [], []
    for _ in range(n):
        t0 = time.perf_counter()
        async with session.post(url, json=PLAIN) as r:
            await r.read()
            status = r.status
        if status == 200:
            latencies.append(time.perf_counter() - t0)
        else:
            failures.append(status)
    out = {"n": n, "failed": len(failures), "failed_statuses": sorted(set(failures))}
    if latencies:
        out |= {"p50_s": percentile(latencies, 0.5), "p99_s": percentile(latencies, 0.99), "max_s": max(latencies)}
    return out


async def attacker(
    session, url: str, body: bytes, attack: Attack, stop: asyncio.Event, statuses: dict[str, int]
) -> None:
    while not stop.is_set():
        t0 = time.monotonic()
        try:
            async with session.post(url, data=body, headers={"Content-Type": "application/json"}) as r:
                if attack.stream:
                    async for _ in r.content.iter_any():
                        if stop.is_set():
                            break
                else:
                    await r.read()
                key = str(r.status)
        except Exception as exc:  # noqa: BLE001 -- count whatever the attack gets back
            key = type(exc).__name__
        statuses[key] = statuses.get(key, 0) + 1
        wait = attack.min_interval_s - (time.monotonic() - t0)
        if wait > 0:
            try:
                await asyncio.wait_for(stop.wait(), wait)
            except asyncio.TimeoutError:
                pass


async def phase(base: str, name: str | None, args) -> dict:
    import aiohttp

    url = f"{base}/predictions/{MODEL_NAME}"
    timeout = aiohttp.ClientTimeout(total=600)
    async with aiohttp.ClientSession(timeout=timeout, connector=aiohttp.TCPConnector(limit=0)) as session:
        if name is None:
            return await plain_latencies(session, url, args.requests)
        attack = ATTACKS[name]
        body = attack_body(name, args)
        stop, statuses = asyncio.Event(), {}
        tasks = [
            asyncio.create_task(attacker(session, url, body, attack, stop, statuses)) for _ in range(attack.clients)
        ]
        await asyncio.sleep(args.settle_s)  # the attacks are in flight before measuring
        result = await plain_latencies(session, url, args.requests)
        stop.set()
        for t in tasks:
            t.cancel()  # a request still in flight is abandoned: the server aborts it
        await asyncio.gather(*tasks, return_exceptions=True)
        result["attack_statuses"] = statuses
        return result


def write_store(store: Path) -> None:
    import yaml

    from pagedserve.engine.model.archive import write_archive
    from pagedserve.engine.model.default_model import default_model_dir

    config = store.parent / "model-config.yaml"
    config.write_text(
        yaml.safe_dump(
            {
                "minWorkers": 1,
                "maxWorkers": 1,
                "responseTimeout": 20,
                "startupTimeout": 900,  # a first start may build the CPU extensions on a busy machine
                "handler": {"dtype": "bfloat16", "kv_cache_memory": "256MiB", "max_model_len": 2048},
            }
        )
    )
    written = write_archive(
        default_model_dir(), store.parent / "build", model_name=MODEL_NAME, version="1.0", config_file=config
    )
    store.mkdir(exist_ok=True)
    written.rename(store / f"{MODEL_NAME}.mar")


def worker_pid(management: str) -> int:
    import urllib.request

    with urllib.request.urlopen(f"{management}/models/{MODEL_NAME}", timeout=30) as r:
        return json.loads(r.read())[0]["workers"][0]["pid"]


def start_server(workdir: Path) -> tuple[subprocess.Popen, str, str]:
    proc, urls = common_start_server(workdir, [f"{MODEL_NAME}={MODEL_NAME}.mar"], timeout=900)
    return proc, urls["inference"], urls["management"]


def cpu_seconds(pid: int) -> float:
    """User + system CPU time of process `pid` (Linux /proc)."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def measured_phase(base: str, name: str | None, args, pids: dict[str, int]) -> dict:
    """One phase, with the CPU seconds each server process used during it and the machine's
    load, to tell a stall of the server from a busy machine. A phase whose plain requests all
    failed has an infinite p50 and p99 (a failed request is not a fast one)."""
    cpu = {k: cpu_seconds(p) for k, p in pids.items()}
    t0 = time.monotonic()
    result = {"p50_s": math.inf, "p99_s": math.inf, **asyncio.run(phase(base, name, args))}
    result["wall_s"] = time.monotonic() - t0
    result["cpu_s"] = {k: cpu_seconds(p) - cpu[k] for k, p in pids.items()}
    result["loadavg_1m"] = os.getloadavg()[0]
    print(
        f"  {name or 'none':12s} p50 {result['p50_s'] * 1000:7.1f} ms p99 {result['p99_s'] * 1000:7.1f} ms"
        f" | plain failed {result['failed']} | attacks {result.get('attack_statuses', {})}"
        f" | front-end CPU {result['cpu_s']['front_end']:.1f} s | load {result['loadavg_1m']:.1f}",
        flush=True,
    )
    return result


def measure_attack(base: str, name: str, args, pids: dict[str, int]) -> PairedRounds:
    """Paired rounds of plain latency with no attack and with attack `name` (the harness's
    alternating order); the rounds compare p99, their p50 view is `replace(..., metric="p50_s")`."""
    print(f"{name}:", flush=True)
    return run_paired(
        "none",
        "attack",
        lambda side: measured_phase(base, None if side == "none" else name, args, pids),
        metric="p99_s",
        rounds=args.rounds,
    )


def summarize(paired: dict[str, PairedRounds]) -> dict:
    summary = {}
    for name, p99 in paired.items():
        p50 = replace(p99, metric="p50_s")
        failed = sum(a["failed"] for a in p99.runs["attack"])
        summary[name] = {
            "p50_ratio_median": p50.ratio_median,
            "p99_ratio_median": p99.ratio_median,
            "p50_ratios": p50.ratios,
            "p99_ratios": p99.ratios,
            "plain_failed_under_attack": failed,
            "p99_within_2x": p99.ratio_median <= 2.0 and failed == 0,
        }
    return summary


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--rounds", type=int, default=MIN_ROUNDS)
    parser.add_argument("--requests", type=int, default=30, help="plain requests per phase")
    parser.add_argument("--attacks", default="grammar,stops,bad_field,huge_prompt")
    parser.add_argument("--stop-count", type=int, default=64)
    parser.add_argument("--stop-len", type=int, default=1024)
    parser.add_argument("--settle-s", type=float, default=1.0)
    args = parser.parse_args()
    attacks = args.attacks.split(",")
    with tempfile.TemporaryDirectory(prefix="attack-latency-") as tmp:
        workdir = Path(tmp)
        write_store(workdir / "store")
        proc, base, management = start_server(workdir)
        try:
            asyncio.run(phase(base, None, argparse.Namespace(**{**vars(args), "requests": 3})))  # warm-up
            pids = {"front_end": proc.pid, "worker": worker_pid(management)}
            rss_start = rss_mib(proc.pid)
            paired = {name: measure_attack(base, name, args, pids) for name in attacks}
            rss = {"start_mib": rss_start, "end_mib": rss_mib(proc.pid), "peak_mib": peak_rss_mib(proc.pid)}
        finally:
            stop_server(proc)
    summary = summarize(paired)
    write_results(args, attacks, paired, summary, rss)
    print(json.dumps({"summary": summary, "front_end_rss": rss}, indent=1))


def write_results(args, attacks: list[str], paired: dict[str, PairedRounds], summary: dict, rss: dict) -> None:
    RESULTS.mkdir(exist_ok=True)
    meta = {
        **provenance([load for p in paired.values() for load in p.loads]),
        "rounds": args.rounds,
        "requests_per_phase": args.requests,
        "stop_strings": f"{args.stop_count} x {args.stop_len} chars",
        "attacks": {name: vars(ATTACKS[name]) for name in attacks},
    }
    rounds = {name: p.summary() for name, p in paired.items()}
    result_path("attack_latency", "json").write_text(
        json.dumps({"meta": meta, "summary": summary, "front_end_rss": rss, "rounds": rounds}, indent=1)
    )
    lines = [
        "# attack_latency",
        "",
        stamp(meta),
        "",
        f"Plain `/predictions` latency (4 tokens, one request at a time, {args.requests} per phase) with "
        f"each attack running vs none; {args.rounds} paired rounds per attack, order flipping each round; "
        f"median of per-round ratios. With {args.requests} requests a phase, p99 is the "
        "slowest request, so one hiccup of the machine decides a round; the median over rounds "
        "is the headline. Per-phase CPU seconds of the server's processes and the load are in "
        "the .json. See benchmarks/attack_latency.py.",
        "",
        "| attack | p50 ratio (median) | p99 ratio (median) | per-round p99 ratios | plain requests failed | p99 within 2x |",
        "| --- | --- | --- | --- | --- | --- |",
    ]
    for name in attacks:
        s = summary[name]
        lines.append(
            f"| {name} | {s['p50_ratio_median']:.2f} | {s['p99_ratio_median']:.2f} | "
            f"{', '.join(f'{r:.2f}' for r in s['p99_ratios'])} | {s['plain_failed_under_attack']} | "
            f"{'yes' if s['p99_within_2x'] else 'no'} |"
        )
    lines += [
        "",
        f"Front end RSS: {rss['start_mib']:.0f} MiB after warm-up, {rss['end_mib']:.0f} MiB at the end, "
        f"peak {rss['peak_mib']:.0f} MiB.",
        "",
    ]
    result_path("attack_latency", "md").write_text("\n".join(lines))


if __name__ == "__main__":
    main()
