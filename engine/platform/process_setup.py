"""Process-wide settings for a process that runs an engine: torch threads, torch's global RNG
seed and glibc's malloc thresholds.

They belong to the owner of the process, which calls `configure_engine_process` once before it
builds its EngineCore: the worker process's main (`pagedserve.engine.core.process.run_engine_core`) and
the offline `pagedserve.engine.llm.LLM`. Neither an import nor the EngineCore or an attention backend
changes them, so an engine built inside another process (a test, a front end) leaves that
process as it was.
"""

from __future__ import annotations

import ctypes
import ctypes.util
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from pagedserve.engine.config.engine import EngineConfig

_M_TRIM_THRESHOLD = -1
_M_MMAP_THRESHOLD = -3


def tune_glibc_malloc(mmap_threshold: int = 32 * 1024 * 1024, trim_threshold: int = 16 * 1024**3) -> bool:
    """Keep large temporaries on the heap instead of mmap/munmap + page faults on every call.

    Same effect as MALLOC_MMAP_THRESHOLD_/MALLOC_TRIM_THRESHOLD_ in the environment; both must
    be set (setting only the trim threshold was measured to be slower). Process-wide: called by
    `configure_engine_process`, never at import. Returns False where mallopt is unavailable.
    """
    name = ctypes.util.find_library("c")
    if name is None:
        return False
    try:
        libc = ctypes.CDLL(name)
        mallopt = libc.mallopt
    except (OSError, AttributeError):
        return False
    return bool(mallopt(_M_MMAP_THRESHOLD, mmap_threshold)) and bool(mallopt(_M_TRIM_THRESHOLD, trim_threshold))


def rank_threads(num_threads: int, size: int) -> int:
    """Torch threads of each of `size` tensor-parallel ranks sharing `num_threads`: an even share,
    at least 1 (on 2 cores with 3 ranks: 1 each; more threads than cores make them wait on each
    other, the big trap on a small CPU)."""
    return max(1, num_threads // size)


def configure_engine_process(config: EngineConfig) -> None:
    """Apply the engine's process-wide settings to the calling process.

    `num_threads` (when set) becomes torch's intra-op thread count; with tensor parallelism the
    process is rank 0 and takes its even share of them (or of torch's count), as each other rank
    does (`rank_threads`); `seed` seeds torch's global RNG (the one draw
    shared by sampled rows without a per-request seed); on a CPU, glibc malloc keeps large
    temporaries on the heap.
    """
    import torch  # the process that runs the engine; memory and thread helpers here need none

    threads = config.num_threads
    if config.tensor_parallel_size > 1:
        threads = rank_threads(threads or torch.get_num_threads(), config.tensor_parallel_size)
    if threads is not None:
        torch.set_num_threads(threads)
    torch.manual_seed(config.seed)
    if torch.device(config.device).type == "cpu":
        tune_glibc_malloc()


def die_with_parent() -> None:
    """Ask Linux to SIGKILL the calling process when the thread that started it ends
    (PR_SET_PDEATHSIG); nothing elsewhere. For processes a parent must never leave behind."""
    import signal

    try:
        libc = ctypes.CDLL("libc.so.6", use_errno=True)
        libc.prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG
    except OSError:
        pass


def release_free_memory() -> bool:
    """Hand the malloc arenas' free memory back to the system (glibc `malloc_trim(0)`).

    The engine process keeps freed heap memory for reuse (the trim threshold above), so memory
    freed on purpose (a worker going to sleep) must be returned explicitly. False where
    malloc_trim is unavailable."""
    name = ctypes.util.find_library("c")
    if name is None:
        return False
    try:
        return bool(ctypes.CDLL(name).malloc_trim(0))
    except (OSError, AttributeError):
        return False


def resident_bytes(pid: int | str = "self") -> int:
    """Resident memory (RSS) of a process and of the processes it started (a tensor-parallel
    worker's ranks are part of the worker), from Linux's /proc; 0 where unknown."""
    import os

    try:
        with open(f"/proc/{pid}/statm") as f:
            pages = int(f.read().split()[1])
    except (OSError, ValueError, IndexError):
        return 0
    pid = os.getpid() if pid == "self" else pid
    try:
        with open(f"/proc/{pid}/task/{pid}/children") as f:
            children = [int(child) for child in f.read().split()]
    except (OSError, ValueError):
        children = []
    return pages * os.sysconf("SC_PAGE_SIZE") + sum(resident_bytes(child) for child in children)
