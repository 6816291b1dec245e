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


@pytest.fixture(scope="module", autouse=True)
def _torch_threads_per_module():
    """An engine built in the test process with `num_threads` sets torch's thread count for the
    whole process, and it used to stay set for every later module of the xdist worker: 2 threads
    per worker beside the other worker's on 2 cores, where OpenMP threads wait on each other.
    The worker's count comes back when the module ends (and after each test, below)."""
    threads = torch.get_num_threads()
    yield
    torch.set_num_threads(threads)


@pytest.fixture(autouse=True)
def _torch_threads_per_test():
    threads = torch.get_num_threads()
    yield
    torch.set_num_threads(threads)


@pytest.fixture(scope="session")
def default_model_dir() -> Path:
    """The default model converted to a plain directory in the user cache (converted once)."""
    from pagedserve.engine.model.default_model import default_gguf_path, default_model_dir

    try:
        default_gguf_path()
    except FileNotFoundError as exc:
        pytest.skip(str(exc))
    return default_model_dir()


TEMP_BUDGET_BYTES = 200 * 1024 * 1024  # what the suite may leave in the temp folder


def _disk_usage(root: Path) -> tuple[int, int]:
    """(bytes of the files under `root`, of which bytes in files hard-linked elsewhere too);
    each inode counted once."""
    seen: set[tuple[int, int]] = set()
    total = linked = 0
    for dirpath, _, names in os.walk(root):
        for name in names:
            try:
                st = os.lstat(os.path.join(dirpath, name))
            except OSError:
                continue
            if (st.st_dev, st.st_ino) in seen:
                continue
            seen.add((st.st_dev, st.st_ino))
            total += st.st_size
            linked += st.st_size if st.st_nlink > 1 else 0
    return total, linked


def pytest_terminal_summary(terminalreporter, config) -> None:
    """What the session left in its temp folder (all xdist workers' folders are under the
    controller's), printed so that CI's output shows it; over TEMP_BUDGET_BYTES is flagged."""
    if os.environ.get("PYTEST_XDIST_WORKER"):
        return
    factory = getattr(config, "_tmp_path_factory", None)
    if factory is None:
        return
    root = factory.getbasetemp()
    total, linked = _disk_usage(root)
    own = total - linked
    verdict = "within" if own <= TEMP_BUDGET_BYTES else "OVER"
    terminalreporter.write_sep("-", "temp folder usage")
    terminalreporter.write_line(
        f"temp folder {root}: {own / 2**20:.1f} MiB left by this session ({verdict} the "
        f"{TEMP_BUDGET_BYTES / 2**20:.0f} MiB budget); {linked / 2**20:.1f} MiB more are hard "
        "links to files kept in the test cache (no extra disk)"
    )
