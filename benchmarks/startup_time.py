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
checkout in it) on the same prepared caches, in the harness's paired rounds (the order reversed
every other round), and prints each round's ratio and the median: on a busy machine only a
paired ratio means anything. Results: benchmarks/results/startup_time.<cpu-kind>.{json,md}.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from _common import RESULTS, result_path

from pagedserve.server.commands.bench.harness import MIN_ROUNDS, PairedRounds, provenance, run_paired, stamp

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


def compare(args, checkout: Path, env: dict[str, str]) -> PairedRounds:
    """The harness's paired rounds of one start of each revision (REV_B / REV_A per round)."""

    def start(rev: str) -> dict:
        subprocess.run(["git", "-C", str(checkout), "checkout", "-q", rev], check=True)
        print(f"{rev}:", flush=True)
        return {"ready_s": time_start(checkout, env, args.timeout)["ready_s"]}

    return run_paired(*args.compare, start, metric="ready_s", rounds=args.rounds)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--checkout", type=Path, default=REPO, help="the checkout to run (default: this one)")
    ap.add_argument("--fresh-cache", action="store_true", help="start from an empty PAGEDSERVE_CACHE_DIR")
    ap.add_argument("--prepare", action="store_true", help="run `pagedserve prepare` first (as .ci/install does)")
    ap.add_argument("--starts", type=int, default=2)
    ap.add_argument("--timeout", type=float, default=600.0)
    ap.add_argument("--cache", type=Path, help="PAGEDSERVE_CACHE_DIR to use (kept); default: the user's")
    ap.add_argument(
        "--compare",
        nargs=2,
        metavar=("REV_A", "REV_B"),
        help="paired starts of two revisions of --checkout (a clone: it is checked out)",
    )
    ap.add_argument("--rounds", type=int, default=MIN_ROUNDS, help="paired rounds of --compare")
    args = ap.parse_args()
    checkout = args.checkout.resolve()
    with tempfile.TemporaryDirectory(prefix="pagedserve-startup-") as tmp:
        cache = Path(tmp) / "cache" if args.fresh_cache else args.cache
        env = environment(checkout, cache)
        result: dict = {"checkout": str(checkout), "fresh_cache": args.fresh_cache, "starts": []}
        if args.compare:
            paired = compare(args, checkout, env)
            result |= provenance(paired.loads) | {"compare": paired.summary()}
            write_results(result, paired.table(" s"))
            return 0
        if args.prepare:
            print("pagedserve prepare:", flush=True)
            result["prepare"] = time_prepare(checkout, env)
            print(f"  {result['prepare']['elapsed_s']:.2f}s", flush=True)
        for i in range(args.starts):
            print(f"start {i + 1}:", flush=True)
            result["starts"].append(time_start(checkout, env, args.timeout))
        result |= provenance()
    rows = ["| start | seconds to ready |", "| --- | --- |"]
    if "prepare" in result:
        rows.append(f"| `pagedserve prepare` | {result['prepare']['elapsed_s']:.2f} |")
    rows += [f"| start {i + 1} | {s['ready_s']:.2f} |" for i, s in enumerate(result["starts"])]
    write_results(result, rows)
    return 0


def write_results(result: dict, rows: list[str]) -> None:
    what = (
        f"Later starts of `{'` and `'.join(result['compare'][k] for k in ('baseline', 'candidate'))}` in paired rounds"
        if "compare" in result
        else f"{len(result['starts'])} starts in a row" + (", fresh caches" if result["fresh_cache"] else "")
    )
    md = [
        "# Start-up time: `pagedserve serve --models default` to its ready line",
        "",
        stamp(result),
        "",
        f"{what}, checkout `{result['checkout']}`; every line the server printed, with its time, is in the .json.",
        "",
        *rows,
    ]
    RESULTS.mkdir(exist_ok=True)
    result_path("startup_time", "json").write_text(json.dumps(result, indent=1) + "\n")
    result_path("startup_time", "md").write_text("\n".join(md) + "\n")
    print("\n".join(md))


if __name__ == "__main__":
    sys.exit(main())
