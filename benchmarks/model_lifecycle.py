"""Model lifecycle: time to first token for a request to a loaded, a sleeping and an unloaded
version of the default model (median of 5 each), and the memory of each state.

One in-process server (pagedserve.server.app.serve.Server on its own loop thread, real HTTP on free ports,
token auth off) over a temporary model store holding the default model archived with
minWorkers 0 (bfloat16, a 256 MiB KV pool). Per case, five rounds of one greedy request of
8 tokens; before each round the version is put in the state under test:

- loaded: nothing to do (it stays loaded: keep_alive -1);
- sleeping: `PUT /models/{m}/{v}/sleep` (weights and KV pool freed, the process kept); the
  request wakes it;
- unloaded: the previous request carried `keep_alive: 0`, so the version was unloaded; the
  request loads a worker process from scratch.

TTFT is the server's own `timings.ttft_s` (from the request's arrival, so the load or wake it
waited for is included). Memory is the sum of the workers' RSS in each state and what the
budget counts. Results go to benchmarks/results/model_lifecycle.<cpu-kind>.{json,md}.

    .venv/bin/python benchmarks/model_lifecycle.py [--rounds 5] [--threads 2]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import shutil
import statistics
import sys
import tempfile
import threading
import time
import urllib.request
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from _common import RESULTS, provenance, result_path, stamp  # noqa: E402

MODEL = "smollm2"
CONFIG = """\
minWorkers: 0
maxWorkers: 1
startupTimeout: 600
responseTimeout: 600
handler:
  dtype: bfloat16
  max_model_len: 2048
  kv_cache_memory: 256MiB
"""


class Bench:
    def __init__(self, store: Path, workdir: Path, threads: int) -> None:
        from pagedserve.server.app.serve import Server
        from pagedserve.server.common.config import ServerConfig

        config = ServerConfig(
            model_store=str(store),
            enable_model_api=True,
            disable_token_auth=True,
            snapshot_path=None,
            worker_threads=threads,
            key_file=str(workdir / "key_file.json"),
            **{f"{a}_address": "127.0.0.1:0" for a in ("inference", "management", "metrics")},
        )
        self.server = Server(config, out=lambda line: None)
        self.loop = asyncio.new_event_loop()
        threading.Thread(target=self.loop.run_forever, daemon=True).start()
        asyncio.run_coroutine_threadsafe(self.server.start(), self.loop).result(600)
        while not self.server.state.registry.startup_done:
            time.sleep(0.05)

    def http(self, method: str, api: str, path: str, body: dict | None = None) -> dict:
        data = json.dumps(body).encode() if body is not None else None
        req = urllib.request.Request(
            f"http://127.0.0.1:{self.server.ports[api]}{path}",
            data=data,
            method=method,
            headers={"Content-Type": "application/json"},
        )
        with urllib.request.urlopen(req, timeout=900) as resp:
            return json.loads(resp.read())

    def predict(self, keep_alive) -> dict:
        return self.http(
            "POST",
            "inference",
            f"/predictions/{MODEL}/1.0",
            {"prompt": "1, 2, 3, 4,", "max_tokens": 8, "temperature": 0, "keep_alive": keep_alive},
        )

    def memory(self) -> dict:
        from pagedserve.engine.platform.process_setup import resident_bytes

        registry = self.server.state.registry
        entry = registry.resolve(MODEL, "1.0")
        pids = [s.engine.pid for s in entry.pool.slots if s.engine is not None and s.engine.pid]
        return {
            "workers_rss_mib": sum(resident_bytes(p) for p in pids) / 2**20,
            "budget_used_mib": registry.lifecycle.used() / 2**20,
        }

    def wait_unloaded(self) -> None:
        entry = self.server.state.registry.resolve(MODEL, "1.0")
        while entry.pool.slots:
            time.sleep(0.05)

    def stop(self) -> None:
        asyncio.run_coroutine_threadsafe(self.server.stop(), self.loop).result(120)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--render", action="store_true", help="only rewrite the .md from the .json")
    args = parser.parse_args()
    if args.render:
        result_path("model_lifecycle", "md").write_text(
            render(json.loads(result_path("model_lifecycle", "json").read_text()))
        )
        return
    from pagedserve.engine.model.archive import write_archive
    from pagedserve.engine.model.default_model import default_model_dir

    tmp = Path(tempfile.mkdtemp(prefix="lifecycle-bench-"))
    os.environ.setdefault("PAGEDSERVE_ARCHIVE_DIR", str(tmp / "archives"))
    (tmp / "store").mkdir()
    (tmp / "model-config.yaml").write_text(CONFIG)
    built = write_archive(
        default_model_dir(), tmp / "build", model_name=MODEL, version="1.0", config_file=tmp / "model-config.yaml"
    )
    built.rename(tmp / "store" / "smollm2.mar")
    bench = Bench(tmp / "store", tmp, args.threads)
    bench.http("POST", "management", "/models?url=smollm2.mar&initial_workers=0&synchronous=true")
    cases: dict[str, dict] = {}
    try:
        first = bench.predict(-1)  # the first load (the page cache warms up)
        reference = first["choices"][0]["token_ids"]
        memory = {"loaded": bench.memory()}
        for case in ("loaded", "sleeping", "unloaded"):
            ttfts, totals = [], []
            for _ in range(args.rounds):
                if case == "sleeping":
                    bench.http("PUT", "management", f"/models/{MODEL}/1.0/sleep")
                    memory.setdefault("sleeping", bench.memory())
                if case == "unloaded":
                    bench.predict(0)  # unloaded right after it
                    bench.wait_unloaded()
                    memory.setdefault("unloaded", bench.memory())
                out = bench.predict(-1)
                assert out["choices"][0]["token_ids"] == reference, "greedy output changed"
                ttfts.append(out["timings"]["ttft_s"])
                totals.append(out["timings"]["total_s"])
            cases[case] = {
                "ttft_median_s": statistics.median(ttfts),
                "ttft_s": ttfts,
                "total_median_s": statistics.median(totals),
            }
            print(case, cases[case], flush=True)
        footprint = bench.server.state.registry.lifecycle.describe_worker(
            bench.server.state.registry.resolve(MODEL, "1.0"),
            bench.server.state.registry.resolve(MODEL, "1.0").pool.slots[0],
        )
    finally:
        bench.stop()
        shutil.rmtree(tmp, ignore_errors=True)  # the archive and its extraction (~1 GiB)
    result = {
        "cases": cases,
        "memory": memory,
        "footprint": footprint,
        "rounds": args.rounds,
        "threads": args.threads,
        "cpus": os.cpu_count(),
        **provenance(),
        "when": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
    }
    RESULTS.mkdir(exist_ok=True)
    result_path("model_lifecycle", "json").write_text(json.dumps(result, indent=2) + "\n")
    result_path("model_lifecycle", "md").write_text(render(result))
    print(render(result))


def render(r: dict) -> str:
    c, m = r["cases"], r["memory"]
    lines = [
        "# Model lifecycle: TTFT and memory per state",
        "",
        stamp(r),
        "",
        f"Default model (SmolLM2-135M, bfloat16, 256 MiB KV pool), one worker, {r['threads']} torch "
        f"threads, {r['cpus']} CPUs, {r['when']} (compare the ratios, not the absolute times). Median of {r['rounds']} requests per state "
        "(8 greedy tokens; the output was identical in every round).",
        "",
        "| state before the request | TTFT median (s) | all TTFTs (s) | workers' RSS in that state (MiB) | budget counts (MiB) |",
        "| --- | --- | --- | --- | --- |",
    ]
    for case in ("loaded", "sleeping", "unloaded"):
        mem = m.get(case, {})
        lines.append(
            f"| {case} | {c[case]['ttft_median_s']:.3f} | "
            f"{', '.join(f'{t:.2f}' for t in c[case]['ttft_s'])} | "
            f"{mem.get('workers_rss_mib', 0):.0f} | {mem.get('budget_used_mib', 0):.0f} |"
        )
    fp = r["footprint"]
    wake = c["sleeping"]["ttft_median_s"] - c["loaded"]["ttft_median_s"]
    cold = c["unloaded"]["ttft_median_s"] - c["loaded"]["ttft_median_s"]
    lines += [
        "",
        f"Footprint of a loaded worker: weights {fp['weights'] / 2**20:.0f} MiB + KV pool "
        f"{fp['kvPool'] / 2**20:.0f} MiB + measured overhead {fp['overhead'] / 2**20:.0f} MiB = "
        f"{fp['total'] / 2**20:.0f} MiB.",
        "",
        f"What the state adds to the TTFT (its median minus the loaded one's): waking "
        f"{wake:.1f} s, a cold load (a new worker process) {cold:.1f} s, so waking is "
        f"{cold / wake:.1f}x faster than a cold load; counting the request's own prefill too "
        f"(median TTFT, unloaded / sleeping) {c['unloaded']['ttft_median_s'] / c['sleeping']['ttft_median_s']:.1f}x.",
        f"Sleeping returned {m['loaded']['workers_rss_mib'] - m['sleeping']['workers_rss_mib']:.0f} MiB "
        f"of RSS, {100 * (m['loaded']['workers_rss_mib'] - m['sleeping']['workers_rss_mib']) / ((fp['weights'] + fp['kvPool']) / 2**20):.0f} % "
        "of weights + KV pool.",
        "",
    ]
    return "\n".join(lines)


if __name__ == "__main__":
    main()
