"""Shared fixtures."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch

# Without a GPU, Triton kernels run in Triton's CPU interpreter. The variable is read when a
# kernel is defined, so it is set here, before any test module imports one.
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")


def pytest_configure(config) -> None:
    """Under pytest-xdist (`-n N`), each of the N workers gets its share of the cores for torch
    in this process and in the processes it starts (OMP_NUM_THREADS): N workers each running
    torch on every core oversubscribe the machine, and OpenMP threads waiting on each other make
    matmuls many times slower. Servers' engine workers set their own count (1 in tests)."""
    workers = int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1"))
    if os.environ.get("PYTEST_XDIST_WORKER") and workers > 1:
        threads = max(1, (os.cpu_count() or 1) // workers)
        os.environ.setdefault("OMP_NUM_THREADS", str(threads))
        torch.set_num_threads(int(os.environ["OMP_NUM_THREADS"]))


@pytest.fixture(scope="session")
def default_model_dir() -> Path:
    """The default model converted to a plain directory in the user cache (converted once)."""
    from engine.model.default_model import default_gguf_path, default_model_dir

    try:
        default_gguf_path()
    except FileNotFoundError as exc:
        pytest.skip(str(exc))
    return default_model_dir()
