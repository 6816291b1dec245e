"""What the benchmark scripts share: workload prompts, peak memory, running one phase of a
script in a fresh child process (its last stdout line is the phase's JSON result), and a
`pagedserve serve` process on free ports."""

from __future__ import annotations

import json
import os
import platform
import random
import resource
import socket
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

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


def peak_rss_mib(pid: int | None = None) -> float:
    """Peak resident memory of this process, or of process `pid` (Linux /proc)."""
    if pid is None:
        return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmHWM:"):
            return int(line.split()[1]) / 1024
    return 0.0


def run_phase(script: str, args: list[str]) -> dict:
    """Run `script --phase ...` in a fresh process; RuntimeError (with its stderr) if it fails."""
    out = subprocess.run([sys.executable, script, *args], check=False, capture_output=True, text=True)
    if out.returncode != 0:
        raise RuntimeError(f"{Path(script).name} {' '.join(args)} failed:\n{out.stderr[-4000:]}")
    return json.loads(out.stdout.strip().splitlines()[-1])


def cpu_kind() -> str:
    """A short name for the kind of CPU, the key of a benchmark's results file
    (`results/<benchmark>.<cpu-kind>.md`): one current file per benchmark per CPU kind."""
    try:
        text = Path("/proc/cpuinfo").read_text()
    except OSError:
        return platform.machine() or "unknown"
    name = next((ln.split(":", 1)[1].strip() for ln in text.splitlines() if ln.startswith("model name")), "")
    flags = set(next((ln.split(":", 1)[1].split() for ln in text.splitlines() if ln.startswith("flags")), []))
    if "AMD" in name:
        return "zen4" if "avx512f" in flags else "zen3" if "avx2" in flags else "amd"
    if "Intel" in name:
        return "xeon-amx" if "amx_bf16" in flags else "xeon" if "avx512f" in flags else "intel"
    return platform.machine() or "unknown"


def result_path(name: str, ext: str) -> Path:
    """Where benchmark `name` writes its `ext` results on this kind of CPU."""
    return RESULTS / f"{name}.{cpu_kind()}.{ext}"


def cpu_description() -> str:
    """The CPU's model name, logical CPU count and the matmul-relevant ISA flags."""
    try:
        text = Path("/proc/cpuinfo").read_text()
    except OSError:
        return platform.processor() or "unknown"
    name = next((ln.split(":", 1)[1].strip() for ln in text.splitlines() if ln.startswith("model name")), "unknown")
    flags = next((ln.split(":", 1)[1].split() for ln in text.splitlines() if ln.startswith("flags")), [])
    isa = [f for f in ("avx512_bf16", "avx512_vnni", "amx_int8", "amx_bf16") if f in flags]
    return f"{name}, {text.count('processor')} logical CPUs, {' '.join(isa) or 'no avx512_bf16/vnni/amx'}"


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start_server(workdir: Path, models: list[str], timeout: float) -> tuple[subprocess.Popen, dict[str, str]]:
    """`pagedserve serve` (token auth off, one engine thread per worker) over `workdir/store`
    with `models` (NAME=ARCHIVE), on free ports; returns once it is ready and lists every model
    (another process may have taken a port picked as free), with each API's base URL."""
    repo = Path(__file__).resolve().parent.parent
    ports = {api: free_port() for api in ("inference", "management", "metrics")}
    # One engine thread: on a shared 2-core machine a 2-thread worker's OpenMP threads stall
    # whenever one of them is descheduled.
    # The caller's PYTHONPATH first: a worktree's shim package then serves its own code.
    path = os.pathsep.join(p for p in (os.environ.get("PYTHONPATH"), str(repo)) if p)
    env = {**os.environ, "PYTHONPATH": path, "PAGEDSERVE_WORKER_THREADS": "1"}
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
