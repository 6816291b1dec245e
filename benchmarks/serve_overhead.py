"""Serving overhead: the same workload through `pagedserve serve` over HTTP vs the offline engine.

Workload: N prompts of about P tokens (token ids, so both sides see the same tokens), O output
tokens each, EOS ignored, greedy, bfloat16, the default model, all requests arriving at once.

- offline: `engine.LLM(...).generate(prompts)` in a fresh process, with `num_threads` torch
  threads. Per-request token times come from wrapping `EngineCore.step` (the time each step
  returned a request's token).
- http: a fresh `pagedserve serve` process with one worker of the same engine options and threads,
  and N concurrent streaming clients (aiohttp, one connection each) in this process, posting
  `POST /predictions/{model}` with `"stream": true` (NDJSON chunks carry token ids, so every
  token is counted where it arrives).

Throughput is output tokens / (last token - first request sent); TTFT is first token - request
sent; ITL is the gap between consecutive token arrivals of a request; TPOT is (last token - first
token) / (tokens - 1) per request. The phases run as the harness's alternating rounds
(`--rounds` of them, the order reversed every other round: offline first, then http first) so that a machine speeding up or slowing down during
the run does not favour one side. The headline is the median of the per-round paired overheads
(each round's http vs the offline run next to it); each side's median round (by throughput) gives the tables' detail. `--threads 2,1` measures with 2 and with 1 engine thread: on a 2-core machine a
2-thread worker shares its cores with the front end and the clients, which stalls its OpenMP
threads; with 1 thread the other core is theirs. Note: the load generator shares the machine with the server (on a 2-core box
it competes with the worker for CPU), so the overhead measured is an upper bound.
Results go to benchmarks/results/serve_overhead.<cpu-kind>.{json,md}.

    .venv/bin/python benchmarks/serve_overhead.py [--num-prompts 32] [--output-len 64] [--threads 2,1] [--rounds 5]
"""

from __future__ import annotations

import argparse
import asyncio
import itertools
import json
import os
import signal
import statistics
import sys
import tempfile
import time
from dataclasses import replace
from pathlib import Path

from _common import RESULTS, make_prompts, peak_rss_mib, result_path, run_phase, start_server, stop_server

from pagedserve.server.commands.bench.harness import (
    MIN_ROUNDS,
    PairedRounds,
    alternating_rounds,
    percentile,
    provenance,
    stamp,
)

REPO = Path(__file__).resolve().parent.parent
MODEL_NAME = "bench"


def percentiles(values: list[float]) -> dict[str, float]:
    if not values:
        return {}
    return {f"p{round(100 * q)}": percentile(values, q) for q in (0.5, 0.9, 0.99)} | {"mean": statistics.fmean(values)}


def summarize(sent: float, token_times: dict[str, list[float]]) -> dict:
    """Throughput and latency figures from each request's token arrival times (send at `sent`)."""
    ttft, itl, tpot = [], [], []
    for times in token_times.values():
        ttft.append(times[0] - sent)
        itl += [b - a for a, b in itertools.pairwise(times)]
        if len(times) > 1:
            tpot.append((times[-1] - times[0]) / (len(times) - 1))
    n_out = sum(len(t) for t in token_times.values())
    elapsed = max(t[-1] for t in token_times.values()) - sent
    return {
        "elapsed_s": elapsed,
        "output_tokens": n_out,
        "tok_per_s": n_out / elapsed,
        "ttft_s": percentiles(ttft),
        "itl_s": percentiles(itl),
        "tpot_s": percentiles(tpot),
    }


def engine_options(args) -> dict:
    return {
        "dtype": "bfloat16",
        "kv_cache_memory": "640MiB",
        "max_num_seqs": max(64, args.num_prompts),
        "max_num_batched_tokens": 2048,
        "max_model_len": 2048,
    }


def cpu_seconds(pid: int) -> float:
    """User + system CPU time of a process (all its threads) so far."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


# -- offline phase (runs in a child process) -----------------------------------------------------


def phase_offline(args, prompts) -> dict:
    from pagedserve.engine import LLM, SamplingParams

    llm = LLM(args.model, num_threads=args.threads, **engine_options(args))
    params = SamplingParams(max_tokens=args.output_len, ignore_eos=True, temperature=0)
    llm.generate([prompts[0][:16]], SamplingParams(max_tokens=2, temperature=0))  # warm-up
    token_times: dict[str, list[float]] = {}
    step = llm.engine.step

    def timed_step():
        outputs = step()
        now = time.perf_counter()
        for out in outputs:
            token_times.setdefault(out.request_id, []).extend([now] * len(out.new_token_ids))
        return outputs

    llm.engine.step = timed_step
    cpu = cpu_seconds(os.getpid())
    load = os.getloadavg()[0]
    sent = time.perf_counter()
    outs = llm.generate(prompts, params)
    assert sum(len(o.outputs[0].token_ids) for o in outs) == len(prompts) * args.output_len
    return summarize(sent, token_times) | {
        "peak_rss_mib": {"process": peak_rss_mib()},
        "cpu_s": {"process": cpu_seconds(os.getpid()) - cpu},
        "loadavg_1m_before": load,
    }


# -- http phase (server in a subprocess, clients here) ---------------------------------------------


def write_store(args, store: Path) -> None:
    import yaml

    from pagedserve.engine.model.archive import write_archive

    config = store.parent / "model-config.yaml"
    config.write_text(yaml.safe_dump({"minWorkers": 1, "maxWorkers": 1, "handler": engine_options(args)}))
    written = write_archive(
        args.model, store.parent / "build", model_name=MODEL_NAME, version="1.0", config_file=config
    )
    store.mkdir(exist_ok=True)
    written.rename(store / f"{MODEL_NAME}.mar")


def phase_http(args, prompts, workdir: Path) -> dict:
    import urllib.request

    proc, urls = start_server(workdir, [f"{MODEL_NAME}={MODEL_NAME}.mar"], timeout=300, worker_threads=args.threads)
    base = urls["inference"]
    try:
        with urllib.request.urlopen(f"{urls['management']}/models/{MODEL_NAME}") as r:
            worker_pid = json.loads(r.read())[0]["workers"][0]["pid"]
        asyncio.run(_drive(base, prompts[:1], args, warmup=True))
        pids = {"front_end": proc.pid, "worker": worker_pid, "client": os.getpid()}
        cpu = {name: cpu_seconds(pid) for name, pid in pids.items()}
        load = os.getloadavg()[0]
        result = asyncio.run(_drive(base, prompts, args))
        result["cpu_s"] = {name: cpu_seconds(pid) - cpu[name] for name, pid in pids.items()}
        result["loadavg_1m_before"] = load
        result["peak_rss_mib"] = {
            "front_end": peak_rss_mib(proc.pid),
            "worker": peak_rss_mib(worker_pid),
            "client": peak_rss_mib(),
        }
        return result
    finally:
        stop_server(proc)


async def _drive(base: str, prompts: list[list[int]], args, warmup: bool = False) -> dict:
    import aiohttp

    url = f"{base}/predictions/{MODEL_NAME}"
    output_len = 2 if warmup else args.output_len
    token_times: dict[str, list[float]] = {}

    async def one(session: aiohttp.ClientSession, i: int, prompt: list[int], start: asyncio.Event) -> None:
        await start.wait()
        body = {"prompt": prompt, "max_tokens": output_len, "ignore_eos": True, "temperature": 0, "stream": True}
        times = token_times.setdefault(str(i), [])
        async with session.post(url, json=body) as resp:
            assert resp.status == 200, await resp.text()
            async for line in resp.content:
                if not line.strip():
                    continue
                now = time.perf_counter()
                chunk = json.loads(line)
                assert "error" not in chunk, chunk
                times.extend([now] * sum(len(c["token_ids"]) for c in chunk["choices"]))

    connector = aiohttp.TCPConnector(limit=0)
    async with aiohttp.ClientSession(connector=connector, timeout=aiohttp.ClientTimeout(total=600)) as session:
        start = asyncio.Event()
        tasks = [asyncio.create_task(one(session, i, p, start)) for i, p in enumerate(prompts)]
        await asyncio.sleep(0.1)  # every task is waiting at the start line
        sent = time.perf_counter()
        start.set()
        await asyncio.gather(*tasks)
    assert sum(len(t) for t in token_times.values()) == len(prompts) * output_len
    return summarize(sent, token_times)


# -- driver ----------------------------------------------------------------------------------------


def run_child(args, phase: str, threads: int, attempts: int = 2) -> dict:
    """Run one phase in a fresh process; a failed attempt (e.g. a port taken by another program
    between choosing and binding it) is reported and retried once."""
    for attempt in range(attempts):
        try:
            return _run_child_once(args, phase, threads)
        except RuntimeError as exc:
            print(f"  {exc}", flush=True)
            if attempt == attempts - 1:
                raise
    raise AssertionError("unreachable")


def _run_child_once(args, phase: str, threads: int) -> dict:
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
            "--threads",
            str(threads),
        ],
    )
    print(
        f"  {phase} ({threads} threads): {result['tok_per_s']:.1f} tok/s, "
        f"TTFT p50 {1000 * result['ttft_s']['p50']:.0f} ms",
        flush=True,
    )
    return result


def compare(runs: dict[str, list[dict]]) -> dict:
    """The paired rounds of one thread count (http / offline per round, the harness's median)."""
    throughput = PairedRounds("offline", "http", "tok_per_s", runs=runs)
    ttft = replace(throughput, metric="ttft_p50_s")
    median_round = {k: sorted(v, key=lambda x: x["tok_per_s"])[(len(v) - 1) // 2] for k, v in runs.items()}
    off, http = median_round["offline"], median_round["http"]
    return {
        "offline_tok_per_s": off["tok_per_s"],
        "http_tok_per_s": http["tok_per_s"],
        "throughput_overhead": 1 - http["tok_per_s"] / off["tok_per_s"],
        "ttft_p50_overhead": http["ttft_s"]["p50"] / off["ttft_s"]["p50"] - 1,
        "per_round_throughput_overhead": [1 - r for r in throughput.ratios],
        "median_throughput_overhead": 1 - throughput.ratio_median,
        "median_ttft_p50_overhead": ttft.ratio_median - 1,
        "median_round": median_round,
        "runs": runs,
    }


def markdown_rows(threads: int, c: dict) -> list[str]:
    off, http = c["median_round"]["offline"], c["median_round"]["http"]

    def ms(d: dict, digits: int = 0) -> str:
        return " / ".join(f"{1000 * d[k]:.{digits}f}" for k in ("p50", "p90", "p99"))

    def rss(d: dict) -> str:
        return ", ".join(f"{k} {v:.0f}" for k, v in d.items())

    def cpu(d: dict) -> str:
        return ", ".join(f"{k} {v:.1f}" for k, v in d.items())

    rounds = ", ".join(f"{100 * x:+.0f} %" for x in c["per_round_throughput_overhead"])
    return [
        f"### {threads} engine thread{'s' if threads > 1 else ''}",
        "",
        "| measure | offline `engine.LLM` | `pagedserve serve` over HTTP |",
        "| --- | --- | --- |",
        f"| throughput | {off['tok_per_s']:.1f} tok/s | {http['tok_per_s']:.1f} tok/s |",
        f"| TTFT p50 / p90 / p99 (ms) | {ms(off['ttft_s'])} | {ms(http['ttft_s'])} |",
        f"| ITL p50 / p90 / p99 (ms) | {ms(off['itl_s'], 1)} | {ms(http['itl_s'], 1)} |",
        f"| TPOT p50 / p90 / p99 (ms) | {ms(off['tpot_s'], 1)} | {ms(http['tpot_s'], 1)} |",
        f"| peak RSS (MiB) | {rss(off['peak_rss_mib'])} | {rss(http['peak_rss_mib'])} |",
        f"| CPU seconds during the run | {cpu(off['cpu_s'])} | {cpu(http['cpu_s'])} |",
        f"| 1-minute load average at the start | {off['loadavg_1m_before']:.1f} | {http['loadavg_1m_before']:.1f} |",
        "",
        (
            f"**Server overhead (median of {len(c['per_round_throughput_overhead'])} paired rounds): throughput "
            f"{100 * c['median_throughput_overhead']:+.1f} %, TTFT p50 {100 * c['median_ttft_p50_overhead']:+.1f} %** "
            f"(target < 10 %; per round: {rounds}). Best round of each side: throughput "
            f"{100 * c['throughput_overhead']:+.1f} %, TTFT p50 {100 * c['ttft_p50_overhead']:+.1f} % (the table's figures)."
        ),
        "",
    ]


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--model", default=None)
    parser.add_argument("--num-prompts", type=int, default=32)
    parser.add_argument("--prompt-len", type=int, default=200)
    parser.add_argument("--output-len", type=int, default=64)
    parser.add_argument(
        "--threads", default="2,1", help="torch threads of the engine / worker; a list compares several"
    )
    parser.add_argument("--rounds", type=int, default=MIN_ROUNDS, help="paired rounds of each phase")
    parser.add_argument("--phase", default=None, help=argparse.SUPPRESS)
    args = parser.parse_args()
    sys.path.insert(0, str(REPO))
    if args.model is None:
        from pagedserve.engine.model.default_model import default_model_dir

        args.model = str(default_model_dir())
    if args.phase:
        from pagedserve.engine.model.tokenizer import load_tokenizer

        # Stopped from outside: unwind, so the server process of the http phase is stopped too.
        signal.signal(signal.SIGTERM, lambda *_: sys.exit(1))
        args.threads = int(args.threads)
        prompts = make_prompts(load_tokenizer(args.model), args.num_prompts, args.prompt_len, seed=0)
        if args.phase == "offline":
            result = phase_offline(args, prompts)
        else:
            with tempfile.TemporaryDirectory(prefix="serve-overhead-") as tmp:
                write_store(args, Path(tmp) / "store")
                result = phase_http(args, prompts, Path(tmp))
        print(json.dumps(result))
        return

    thread_counts = [int(t) for t in args.threads.split(",")]
    sides = [f"{phase}@{t}" for t in thread_counts for phase in ("offline", "http")]

    def measure(side: str) -> dict:
        phase, threads = side.split("@")
        result = run_child(args, phase, int(threads))
        return result | {"ttft_p50_s": result["ttft_s"]["p50"], "loadavg_1m_after": os.getloadavg()[0]}

    def done(r: int, order: tuple[str, ...], runs: dict[str, list[dict]]) -> None:
        print(f"round {r + 1}/{args.rounds} done ({', '.join(order)})", flush=True)
        write_results(args, thread_counts, runs)  # a later failure keeps these

    # Each round runs every (phase, threads) side, the order reversed every other round: a
    # thread count's offline and http runs stay next to each other, either one first.
    alternating_rounds(sides, measure, args.rounds, on_round=done)


def write_results(args, thread_counts: list[int], runs: dict[str, list[dict]]) -> None:
    results = {str(t): compare({p: runs[f"{p}@{t}"] for p in ("offline", "http")}) for t in thread_counts}
    rounds_done = len(runs[f"http@{thread_counts[0]}"])
    loads = [r["loadavg_1m_after"] for side in runs.values() for r in side]
    summary = {
        "workload": {
            "num_prompts": args.num_prompts,
            "prompt_len": args.prompt_len,
            "output_len": args.output_len,
            "dtype": "bfloat16",
            "concurrency": args.num_prompts,
            "cpus": os.cpu_count(),
            "rounds": rounds_done,
        },
        **provenance(loads),
        "date": time.strftime("%Y-%m-%d %H:%M"),
        "by_threads": results,
    }
    RESULTS.mkdir(exist_ok=True)
    result_path("serve_overhead", "json").write_text(json.dumps(summary, indent=2) + "\n")
    md = [
        "# Serving overhead: HTTP server vs offline engine (latest run)",
        "",
        stamp(summary),
        "",
        (
            f"{args.num_prompts} concurrent requests x {args.prompt_len} prompt tokens, {args.output_len} output "
            f"tokens (EOS ignored, greedy), bf16, {os.cpu_count()} CPUs; {rounds_done} rounds, the order of the two "
            "sides flipping every round; the tables show each side's median round (by throughput). HTTP: `pagedserve serve` with one worker, every request a streaming "
            "`/predictions` (NDJSON) from its own aiohttp connection; the clients run on the same machine."
        ),
        "",
    ]
    for t in thread_counts:
        md += markdown_rows(t, results[str(t)])
    # Each side at the thread setting where its median round is fastest: what a user of either one gets.
    off_t = max(thread_counts, key=lambda t: results[str(t)]["offline_tok_per_s"])
    http_t = max(thread_counts, key=lambda t: results[str(t)]["http_tok_per_s"])
    off_best, http_best = results[str(off_t)]["offline_tok_per_s"], results[str(http_t)]["http_tok_per_s"]
    summary["best_settings"] = {
        "offline_threads": off_t,
        "http_threads": http_t,
        "throughput_overhead": 1 - http_best / off_best,
    }
    result_path("serve_overhead", "json").write_text(json.dumps(summary, indent=2) + "\n")
    md += [
        (
            f"**Each side at its best thread setting** (offline engine {off_t} thread(s): {off_best:.1f} tok/s; "
            f"server, worker with {http_t} thread(s): {http_best:.1f} tok/s): server overhead "
            f"**{100 * (1 - http_best / off_best):+.1f} %** of throughput."
        ),
        "",
    ]
    md.append(f"Run on {summary['date']}.")
    result_path("serve_overhead", "md").write_text("\n".join(md) + "\n")
    print("\n".join(md))


if __name__ == "__main__":
    main()
