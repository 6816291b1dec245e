"""How an engine worker process starts.

A spawned worker imports torch and the model code itself: ~2 s of CPU before it reads a byte of
its model, paid again by every worker a server starts, scales up or restarts. On a machine
without a GPU driver, workers are instead forked from multiprocessing's fork server with the
engine core preloaded: the fork server imports it once, the first time a process starts a
worker, and each worker after that begins with it imported. Where a GPU driver is loaded,
workers are spawned as before: a process must not fork once CUDA is initialized, and a worker's
devices are chosen per worker (`CUDA_VISIBLE_DEVICES`, set in the worker before CUDA starts).

The fork server keeps the environment of the moment it started; a worker gets the environment
of its own start (`worker_environment()`, applied first thing in the worker), as a spawned one
does.
"""

from __future__ import annotations

import multiprocessing
import os
from multiprocessing.context import ForkServerContext, SpawnContext

# Present when a GPU driver torch can use is loaded: NVIDIA's (CUDA) or AMD's (ROCm).
GPU_DRIVER_PATHS = ("/proc/driver/nvidia", "/dev/nvidiactl", "/dev/kfd")
PRELOAD = ["pagedserve.engine.core.engine_core"]


def gpu_driver_present() -> bool:
    """Whether a GPU driver is loaded here: without one torch sees no GPU (so a process that
    only asks need not import torch to hear it)."""
    return any(os.path.exists(p) for p in GPU_DRIVER_PATHS)


def worker_context() -> SpawnContext | ForkServerContext:
    """The multiprocessing context engine workers start from (see the module docstring)."""
    if gpu_driver_present():
        return multiprocessing.get_context("spawn")
    context = multiprocessing.get_context("forkserver")
    context.set_forkserver_preload(PRELOAD)
    return context


def worker_environment() -> dict[str, str]:
    """The environment a worker starts with: the starting process's, now."""
    return dict(os.environ)


def apply_environment(environ: dict[str, str]) -> None:
    """In the worker, before anything reads it."""
    if environ != os.environ:
        os.environ.clear()
        os.environ.update(environ)
