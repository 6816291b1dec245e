"""benchmarks/gpu_check.py on a machine without a CUDA device: it says so and exits 0."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def test_gpu_check_on_a_cpu_machine_says_so_and_exits_0():
    env = dict(os.environ, CUDA_VISIBLE_DEVICES="")  # no device even where one is lent
    out = subprocess.run(
        [sys.executable, str(ROOT / "benchmarks" / "gpu_check.py")],
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
        check=False,
    )
    assert out.returncode == 0, out.stderr
    assert "no CUDA device here" in out.stdout
    assert "PASS" not in out.stdout and "FAIL" not in out.stdout
