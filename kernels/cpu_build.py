"""Shared build logic for the CPU C++ extensions (compiled once per machine with cpp_extension).

Builds go to `$PAGEDSERVE_CACHE_DIR/torch_extensions` (default `~/.cache/pagedserve/...`), one
directory per (source, flags, torch version, CPU, source and torch paths) so a stale or foreign
build is never loaded.
`PAGEDSERVE_DISABLE_CPU_KERNELS=1` turns every extension off (callers then use the torch path).
"""

from __future__ import annotations

import hashlib
import logging
import os
from pathlib import Path

import torch

logger = logging.getLogger(__name__)


def build_dir() -> Path:
    base = Path(os.environ.get("PAGEDSERVE_CACHE_DIR", Path.home() / ".cache" / "pagedserve"))
    return base / "torch_extensions"


def cpu_signature() -> bytes:
    try:
        lines = Path("/proc/cpuinfo").read_text().splitlines()
    except OSError:
        return b"unknown-cpu"
    wanted = [line for line in lines if line.startswith(("model name", "flags"))][:2]
    return "\n".join(wanted).encode()


def build_tag(source: Path, cflags: tuple[str, ...]) -> str:
    """The build folder's key: the source, flags, torch version and CPU (-march=native: a build
    is only valid on the CPU it was made for), and the source's and torch's paths, which
    cpp_extension writes into build.ninja: without them two checkouts (or venvs) sharing one
    cache would rebuild the extension for each other at every load."""
    paths = f"{source.resolve()}:{Path(torch.__file__).parent}".encode()
    key = source.read_bytes() + repr(cflags).encode() + torch.__version__.encode() + cpu_signature() + paths
    return hashlib.sha256(key).hexdigest()[:10]


def load_cpu_extension(name: str, source: Path, cflags: tuple[str, ...]):
    """Compile (first call on a machine, ~30-60 s) or load `source` as module `name`; None if unavailable.

    `cflags` should carry -fopenmp so at::parallel_for uses torch's own thread pool.
    """
    if os.environ.get("PAGEDSERVE_DISABLE_CPU_KERNELS") == "1":
        return None
    from torch.utils.cpp_extension import load

    tag = build_tag(source, cflags)
    build = build_dir() / f"{name}_{tag}"
    build.mkdir(parents=True, exist_ok=True)
    logger.info("loading the CPU extension %s (built once per machine, ~30-60 s)", name)
    try:
        return load(
            name=f"pagedserve_{name}_{tag}",
            sources=[str(source)],
            extra_cflags=list(cflags),
            extra_ldflags=["-fopenmp"],  # resolves to the libgomp torch already loaded
            build_directory=str(build),
            verbose=False,
        )
    except Exception as exc:  # no compiler, no ninja, ...: the torch path still works
        logger.warning("CPU extension %s unavailable, using the torch path: %s", name, exc)
        return None
