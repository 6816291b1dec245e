"""Start-up time: seconds from `pagedserve serve --models default` to its "ready" line.

Runs the README's first command (after `.ci/install`) in a checkout, twice in a row (the first
and the second start), and prints every line the server printed with the second it appeared, so
what takes the time is visible. With `--fresh-cache` the caches (`PAGEDSERVE_CACHE_DIR`) start
empty: `--prepare` then first runs `pagedserve prepare` (what `.ci/install` does) into them, and
its time is reported apart; without `--prepare` the first start builds everything itself.

    .venv/bin/python benchmarks/startup_time.py [--checkout DIR] [--fresh-cache] [--prepare]

To measure a fresh clone without touching the shared venv: `git clone /work/main /tmp/x`, then
`--checkout /tmp/x` (the clone's own code is put first on PYTHONPATH; its model_store/ starts
empty). The ports are picked free (port 0), so the script runs beside other servers.

`--compare REV_A REV_B --cache DIR` measures later starts of two revisions of that clone (git
checkout in it) on the same prepared caches, in paired rounds with the order reversed every
other round, and prints each round's ratio and the median: on a busy machine only a paired
ratio means anything.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from statistics import median

from _common import RESULTS, result_path

REPO = Path(__file__).resolve().parent.parent
READY = "pagedserve: ready"


def environment(checkout: Path, cache: Path | None) -> dict[str, str]:
    env = dict(os.environ, PYTHONPATH=str(checkout), PYTHONUNBUFFERED="1")
    if cache is not None:
        env["PAGEDSERVE_CACHE_DIR"] = str(cache)
    return env


def pagedserve(checkout: Path) -> list[str]:
    """The checkout's own CLI, whatever package the venv's `pagedserve` script points at."""
    return [sys.executable, "-c", "import sys; from pagedserve.server.cli import main; sys.exit(main())"]


def time_prepare(checkout: Path, env: dict[str, str]) -> dict:
    start = time.perf_counter()
    out = subprocess.run(
        [*pagedserve(checkout), "prepare"], cwd=checkout, env=env, capture_output=True, text=True, check=False
    )
    elapsed = time.perf_counter() - start
    if out.returncode != 0:
        raise RuntimeError(f"pagedserve prepare failed:\n{out.stdout}\n{out.stderr[-4000:]}")
    return {"elapsed_s": round(elapsed, 2), "output": out.stdout.splitlines()}


def time_start(checkout: Path, env: dict[str, str], timeout: float) -> dict:
    """One start: every output line with its time, until the ready line; then SIGTERM."""
    cmd = [
        *pagedserve(checkout),
        "serve",
        "--models",
        "default",
        "--inference-address",
        "127.0.0.1:0",
        "--management-address",
        "127.0.0.1:0",
        "--metrics-address",
        "127.0.0.1:0",
    ]
    start = time.perf_counter()
    proc = subprocess.Popen(cmd, cwd=checkout, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    lines: list[tuple[float, str]] = []
    ready = None
    try:
        for line in proc.stdout:
            now = time.perf_counter() - start
            lines.append((round(now, 2), line.rstrip()))
            print(f"  {now:6.2f}s  {line.rstrip()}", flush=True)
            if READY in line:
                ready = now
                break
            if now > timeout:
                break
    finally:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.communicate(timeout=60)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.communicate()
    if ready is None or "(0 model" in lines[-1][1]:
        raise RuntimeError(
            "the server did not get ready with its model:\n" + "\n".join(f"{t:6.2f}s  {text}" for t, text in lines)
        )
    return {"ready_s": round(ready, 2), "lines": lines}


def compare(args, checkout: Path, env: dict[str, str]) -> dict:
    """Paired rounds of one start of each revision; the median ratio REV_B / REV_A."""
    revs = args.compare
    times: dict[str, list[float]] = {rev: [] for rev in revs}
    for r in range(args.rounds):
        for rev in revs if r % 2 == 0 else revs[::-1]:
            subprocess.run(["git", "-C", str(checkout), "checkout", "-q", rev], check=True)
            print(f"round {r + 1}, {rev}:", flush=True)
            times[rev].append(time_start(checkout, env, args.timeout)["ready_s"])
        print(f"  round {r + 1}: {revs[1]} / {revs[0]} = {times[revs[1]][-1] / times[revs[0]][-1]:.2f}", flush=True)
    ratios = [b / a for a, b in zip(times[revs[0]], times[revs[1]])]
    return {
        "ready_s": times,
        "ratios": ratios,
        "median_ratio": median(ratios),
        "median_ready_s": {rev: median(t) for rev, t in times.items()},
    }


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--checkout", type=Path, default=REPO, help="the checkout to run (default: this one)")
    ap.add_argument("--fresh-cache", action="store_true", help="start from an empty PAGEDSERVE_CACHE_DIR")
    ap.add_argument("--prepare", action="store_true", help="run `pagedserve prepare` first (as .ci/install does)")
    ap.add_argument("--starts", type=int, default=2)
    ap.add_argument("--timeout", type=float, default=600.0)
    ap.add_argument("--name", default="startup_time", help="results file name (without suffix)")
    ap.add_argument("--cache", type=Path, help="PAGEDSERVE_CACHE_DIR to use (kept); default: the user's")
    ap.add_argument(
        "--compare",
        nargs=2,
        metavar=("REV_A", "REV_B"),
        help="paired starts of two revisions of --checkout (a clone: it is checked out)",
    )
    ap.add_argument("--rounds", type=int, default=5, help="paired rounds of --compare")
    args = ap.parse_args()
    checkout = args.checkout.resolve()
    with tempfile.TemporaryDirectory(prefix="pagedserve-startup-") as tmp:
        cache = Path(tmp) / "cache" if args.fresh_cache else args.cache
        env = environment(checkout, cache)
        result: dict = {
            "checkout": str(checkout),
            "fresh_cache": args.fresh_cache,
            "machine": platform.processor() or platform.machine(),
            "load_before": os.getloadavg()[0],
            "starts": [],
        }
        if args.compare:
            result["compare"] = compare(args, checkout, env)
            result["load_after"] = os.getloadavg()[0]
            print(json.dumps({k: v for k, v in result["compare"].items() if k != "ready_s"}))
            RESULTS.mkdir(exist_ok=True)
            result_path(f"{args.name}", "json").write_text(json.dumps(result, indent=1) + "\n")
            return 0
        if args.prepare:
            print("pagedserve prepare:", flush=True)
            result["prepare"] = time_prepare(checkout, env)
            print(f"  {result['prepare']['elapsed_s']:.2f}s", flush=True)
        for i in range(args.starts):
            print(f"start {i + 1}:", flush=True)
            result["starts"].append(time_start(checkout, env, args.timeout))
        result["load_after"] = os.getloadavg()[0]
    print(
        json.dumps(
            {
                "prepare_s": result.get("prepare", {}).get("elapsed_s"),
                "ready_s": [s["ready_s"] for s in result["starts"]],
            }
        )
    )
    RESULTS.mkdir(exist_ok=True)
    result_path(f"{args.name}", "json").write_text(json.dumps(result, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
