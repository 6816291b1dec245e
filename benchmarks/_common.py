"""What the benchmark scripts share: workload prompts, peak memory, and running one phase of a
script in a fresh child process (its last stdout line is the phase's JSON result)."""

from __future__ import annotations

import json
import random
import resource
import subprocess
import sys
from pathlib import Path

RESULTS = Path(__file__).resolve().parent / "results"


def make_prompts(tokenizer, num: int, length: int, seed: int) -> list[list[int]]:
    """Distinct prompts of exactly `length` tokens: random words, so no two share a prefix."""
    rng = random.Random(seed)
    words = [w for w in tokenizer.get_vocab() if w.isalpha() and len(w) > 3][:5000]
    return [tokenizer.encode(" ".join(rng.choice(words) for _ in range(length * 2)),
                             add_special_tokens=False)[:length] for _ in range(num)]


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
