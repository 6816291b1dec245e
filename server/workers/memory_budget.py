"""The server-wide memory budget and what each worker counts against it.

A worker's footprint is its weights + its KV pool + the process's overhead (Python, torch,
the tokenizer, kernels, buffers). Weights and KV pool are computed from the model directory
(safetensors headers, the dtype) and the engine options (`kv_cache_memory` / `num_kv_blocks`).
The overhead is measured: the resident memory (RSS) of each worker right after it became ready,
minus its weights and KV pool; the largest overhead seen so far is the estimate for the next
worker (`INITIAL_OVERHEAD` only until the first worker has been measured). A sleeping worker
counts what it measured after falling asleep. Every count is also never less than the worker's
RSS at the moment it is read, so the budget's book never undercounts the real memory.
"""

from __future__ import annotations

import json
import os
import struct
from dataclasses import dataclass
from pathlib import Path

from pagedserve.engine.config.engine import EngineConfig, dtype_itemsize, parse_size
from pagedserve.engine.platform.process_setup import resident_bytes
from pagedserve.engine.platform.worker_start import gpu_driver_present

DEFAULT_FRACTION = 0.75  # of the machine's memory (of the device's on a GPU), when none is set
INITIAL_OVERHEAD = 640 << 20  # a worker's overhead before any worker has been measured (torch CPU)
_DTYPE_BYTES = {
    "F64": 8,
    "F32": 4,
    "F16": 2,
    "BF16": 2,
    "I64": 8,
    "I32": 4,
    "I16": 2,
    "I8": 1,
    "U8": 1,
    "BOOL": 1,
    "F8_E4M3": 1,
    "F8_E5M2": 1,
}
_FLOATS = {"F64", "F32", "F16", "BF16"}


class ModelTooLargeError(RuntimeError):
    """A registration whose workers cannot fit the budget (507); the message names both sizes."""

    status = 507


def machine_memory() -> int:
    """Physical memory of this machine, or of the GPU when torch sees one (torch is asked only
    where a GPU driver is loaded)."""
    if gpu_driver_present():
        try:
            import torch

            if torch.cuda.is_available():
                return int(torch.cuda.get_device_properties(0).total_memory)
        except (ImportError, RuntimeError):
            pass
    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")


def resolve_budget(value: int | str | None) -> int:
    """The budget in bytes: a size ("12GiB", bytes), or None for DEFAULT_FRACTION of memory."""
    if value is None:
        return int(machine_memory() * DEFAULT_FRACTION)
    try:
        size = parse_size(value)
    except ValueError as exc:
        raise ValueError(f"memory_budget: {exc}") from None
    if size <= 0:
        raise ValueError(f"memory_budget: must be > 0, got {value!r}")
    return size


def fmt(n: int) -> str:
    """Bytes as MiB / GiB for messages."""
    return f"{n / (1 << 30):.2f} GiB" if n >= 1 << 30 else f"{n / (1 << 20):.1f} MiB"


def weights_bytes(model_dir: Path, dtype_bytes: int) -> int:
    """Bytes of the weights once loaded: floating tensors in the engine's dtype, the rest as
    stored. Read from the safetensors headers only (nothing is loaded)."""
    total = 0
    for path in sorted(Path(model_dir).glob("*.safetensors")):
        with open(path, "rb") as f:
            (length,) = struct.unpack("<Q", f.read(8))
            header = json.loads(f.read(length))
        for name, info in header.items():
            if name == "__metadata__":
                continue
            count = 1
            for dim in info["shape"]:
                count *= dim
            kind = info["dtype"]
            total += count * (dtype_bytes if kind in _FLOATS else _DTYPE_BYTES.get(kind, 1))
    return total


def kv_pool_bytes(config: EngineConfig, hf_config: dict) -> int:
    """Bytes of the KV pool the engine allocates for `config`, by the engine's own rule
    (pagedserve.engine.model.loader.kv_pool_size): with tensor parallelism every rank holds every block
    for its share of the KV heads, and a KV head replicated on several ranks (fewer KV heads
    than ranks) costs each copy."""
    from pagedserve.engine.attention.kv_dtype import parse_kv_cache_dtype
    from pagedserve.engine.model.kv_pool_size import kv_pool_size
    from pagedserve.engine.model.registry import parse_config
    from pagedserve.engine.model.sharding import shard_spec

    spec = parse_config(hf_config)
    if config.tensor_parallel_size > 1:
        spec = shard_spec(spec, config.tensor_parallel_size)
    per_block, blocks = kv_pool_size(config, spec, parse_kv_cache_dtype(config.kv_cache_dtype))
    return blocks * per_block


def path_sizes(path: Path, config: EngineConfig) -> tuple[int, int, str]:
    """(weights, KV pool, what they were read from) of a worker of the archive that a .gguf file
    or model folder becomes, estimated before anything is converted or copied: the weights from
    the GGUF's tensor table (every weight de-quantized to `config`'s dtype) or the folder's
    safetensors headers; the KV pool from its config.json, or for a GGUF (no config.json yet)
    `kv_cache_memory`, which the pool fills to within one block."""
    from pagedserve.engine.model.path_source import gguf_summary

    itemsize = dtype_itemsize(config.dtype)
    if path.is_file():  # ValueError first for an architecture or tensor type it cannot serve
        kv = parse_size(config.kv_cache_memory) if config.num_kv_blocks is None else 0
        return gguf_summary(path)["weights"] * itemsize, kv, "its GGUF tensor table"
    hf_config = json.loads((path / "config.json").read_text())
    return weights_bytes(path, itemsize), kv_pool_bytes(config, hf_config), "its config.json and safetensors headers"


@dataclass(slots=True, frozen=True)
class Footprint:
    """What one worker of a version counts against the budget."""

    weights: int
    kv_pool: int
    overhead: int
    measured: bool  # overhead measured on this worker (else the server-wide estimate)

    @property
    def total(self) -> int:
        return self.weights + self.kv_pool + self.overhead

    def as_json(self) -> dict[str, int | bool]:
        return {
            "weights": self.weights,
            "kvPool": self.kv_pool,
            "overhead": self.overhead,
            "total": self.total,
            "overheadMeasured": self.measured,
        }


def version_sizes(config: EngineConfig) -> tuple[int, int]:
    """(weights, KV pool) bytes of one worker built from `config`."""
    model_dir = Path(config.model)
    hf_config = json.loads((model_dir / "config.json").read_text())
    return (weights_bytes(model_dir, dtype_itemsize(config.dtype)), kv_pool_bytes(config, hf_config))


class MemoryBudget:
    """The budget's size and the overhead measured so far; the lifecycle keeps the book."""

    def __init__(self, total: int) -> None:
        self.total = total
        self.overhead: int | None = None  # the largest measured overhead; None: none measured

    @property
    def overhead_estimate(self) -> int:
        return self.overhead if self.overhead is not None else INITIAL_OVERHEAD

    def measure(self, pid: int | None, weights: int, kv_pool: int) -> int:
        """A ready worker's overhead (its RSS minus weights and KV pool); updates the estimate."""
        rss = resident_bytes(pid) if pid is not None else 0
        overhead = max(0, rss - weights - kv_pool)
        if rss:
            self.overhead = max(self.overhead or 0, overhead)
        return overhead
