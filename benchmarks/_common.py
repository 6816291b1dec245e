"""What the benchmark scripts share besides the harness (paired rounds, peak memory, the CPU's
name, the results' paths and provenance: pagedserve.server.commands.bench.harness, which
`pagedserve bench` uses too): workload prompts, running one phase of a script in a fresh child
process (its last stdout line is the phase's JSON result), and a `pagedserve serve` process on
free ports, and stopping it."""

from __future__ import annotations

import json
import os
import random
import signal
import socket
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

from pagedserve.server.commands.bench import harness
from pagedserve.server.commands.bench.harness import cpu_description, cpu_kind, peak_rss_mib, provenance, stamp

__all__ = ["cpu_description", "cpu_kind", "peak_rss_mib", "provenance", "stamp"]  # for the scripts
RESULTS = Path(__file__).resolve().parent / "results"


def make_prompts(tokenizer, num: int, length: int, seed: int) -> list[list[int]]:
    """Distinct prompts of exactly `length` tokens: random words, so no two share a prefix."""
    rng = random.Random(seed)
    # Sorted: get_vocab()'s order differs between processes, and paired phases run in separate ones.
    words = sorted(w for w in tokenizer.get_vocab() if w.isalpha() and len(w) > 3)[:5000]
    return [
        tokenizer.encode(" ".join(rng.choice(words) for _ in range(length * 2)), add_special_tokens=False)[:length]
        for _ in range(num)
    ]


def run_phase(script: str, args: list[str], echo: bool = False) -> dict:
    """Run `script --phase ...` in a fresh process; its last stdout line is its JSON result (with
    `echo`, the lines before it are printed). RuntimeError (with its stderr) if it fails."""
    out = subprocess.run([sys.executable, script, *args], check=False, capture_output=True, text=True)
    if out.returncode != 0:
        raise RuntimeError(f"{Path(script).name} {' '.join(args)} failed:\n{out.stdout[-2000:]}\n{out.stderr[-4000:]}")
    *lines, last = out.stdout.strip().splitlines()
    if echo and lines:
        print("\n".join(lines), flush=True)
    return json.loads(last)


def result_path(name: str, ext: str) -> Path:
    """Where benchmark `name` writes its `ext` results on this kind of CPU (one current file
    per benchmark and CPU kind; the history is in git)."""
    return harness.result_path(RESULTS, name, ext)


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start_server(
    workdir: Path, models: list[str], timeout: float, worker_threads: int = 1
) -> tuple[subprocess.Popen, dict[str, str]]:
    """`pagedserve serve` (token auth off, `worker_threads` engine threads per worker) over
    `workdir/store` with `models` (NAME=ARCHIVE), on free ports; returns once it is ready and
    lists every model (another process may have taken a port picked as free), with each API's
    base URL."""
    repo = Path(__file__).resolve().parent.parent
    ports = {api: free_port() for api in ("inference", "management", "metrics")}
    # One engine thread by default: on a shared 2-core machine a 2-thread worker's OpenMP
    # threads stall whenever one of them is descheduled.
    # The caller's PYTHONPATH first: a worktree's shim package then serves its own code.
    path = os.pathsep.join(p for p in (os.environ.get("PYTHONPATH"), str(repo)) if p)
    env = {**os.environ, "PYTHONPATH": path, "PAGEDSERVE_WORKER_THREADS": str(worker_threads)}
    cmd = [
        sys.executable,
        "-m",
        "pagedserve.server.cli",
        "serve",
        "--model-store",
        str(workdir / "store"),
        *(["--models", *models] if models else []),
        "--disable-token-auth",
        *(arg for api, port in ports.items() for arg in (f"--{api}-address", f"127.0.0.1:{port}")),
    ]
    with open(workdir / "server.log", "ab") as log:
        proc = subprocess.Popen(cmd, cwd=workdir, env=env, stdout=log, stderr=subprocess.STDOUT)
    urls = {api: f"http://127.0.0.1:{port}" for api, port in ports.items()}
    wanted = {m.split("=", 1)[0] for m in models}
    deadline = time.monotonic() + timeout
    while True:
        if proc.poll() is not None:
            raise RuntimeError(f"server exited: {(workdir / 'server.log').read_text()[-3000:]}")
        try:
            with (
                urllib.request.urlopen(urls["inference"] + "/ready", timeout=5) as ready,
                urllib.request.urlopen(urls["inference"] + "/v1/models", timeout=5) as listed,
            ):
                names = {m["id"] for m in json.loads(listed.read())["data"]}
                if ready.status == 200 and wanted <= names:
                    return proc, urls
        except OSError:
            pass
        if time.monotonic() > deadline:
            proc.kill()
            proc.wait(30)
            raise TimeoutError("server not ready")
        time.sleep(0.5)


def stop_server(proc: subprocess.Popen, timeout: float = 60) -> None:
    """SIGTERM (the server drains and stops its workers), then SIGKILL if it outlives `timeout`."""
    proc.send_signal(signal.SIGTERM)
    try:
        proc.wait(timeout)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait(30)
