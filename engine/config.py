"""Engine configuration: one dataclass, validated at construction.

Its field annotations are the declaration model-config.yaml's `handler:` section is checked
against (engine.model.model_config derives the keys and their types from them, with the bounds
given here as `Annotated[..., msgspec.Meta(...)]`): a new field is a new key there.
"""

from __future__ import annotations

import enum
import re
from dataclasses import asdict, dataclass, field
from typing import Annotated

import torch
from msgspec import Meta

from engine.attention.kv_quant import parse_kv_cache_dtype
from engine.attention.selector import BACKEND_NAMES
from engine.kv_offload.config import KVOffloadConfig
from engine.model.compile import CompileMode
from engine.spec_decode.config import SpeculativeConfig


class SchedulingPolicy(enum.Enum):
    FCFS = "fcfs"
    PRIORITY = "priority"


class PrefixCacheHash(enum.Enum):
    SHA256 = "sha256"
    # Python's built-in hash over a tuple: fast, not collision-resistant across tenants.
    BUILTIN = "builtin"


_DTYPES = {
    "float32": torch.float32,
    "fp32": torch.float32,
    "bfloat16": torch.bfloat16,
    "bf16": torch.bfloat16,
    "float16": torch.float16,
    "fp16": torch.float16,
}

MAX_TENSOR_PARALLEL = 64  # ranks of one worker

_SIZE_RE = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*([KMGT]i?B|B)?\s*$", re.IGNORECASE)
_SIZE_UNITS = {
    "b": 1,
    "kb": 10**3, "mb": 10**6, "gb": 10**9, "tb": 10**12,
    "kib": 2**10, "mib": 2**20, "gib": 2**30, "tib": 2**40,
}


def parse_size(value: int | str) -> int:
    """Parse a byte size such as 2147483648, "2GiB", "512MB" or "1.5 GiB"."""
    if isinstance(value, bool):
        raise ValueError(f"invalid size {value!r}")
    if isinstance(value, int):
        if value <= 0:
            raise ValueError(f"size must be positive, got {value}")
        return value
    match = _SIZE_RE.match(str(value))
    if not match:
        raise ValueError(f"invalid size {value!r}: expected e.g. 2GiB, 512MiB or a byte count")
    number, unit = float(match.group(1)), (match.group(2) or "B").lower()
    size = int(number * _SIZE_UNITS[unit])
    if size <= 0:
        raise ValueError(f"size must be positive, got {value!r}")
    return size


def _coerce_enum(enum_cls: type[enum.Enum], name: str, value: object) -> enum.Enum:
    try:
        return enum_cls(value.value if isinstance(value, enum_cls) else value)
    except ValueError:
        allowed = [member.value for member in enum_cls]
        raise ValueError(f"{name}: choose one of {allowed}, got {value!r}") from None


def resolve_dtype(value: str | torch.dtype) -> torch.dtype:
    if isinstance(value, torch.dtype):
        if value not in _DTYPES.values():
            raise ValueError(f"unsupported dtype {value}")
        return value
    try:
        return _DTYPES[str(value).lower()]
    except KeyError:
        raise ValueError(f"unsupported dtype {value!r}: choose one of {sorted(_DTYPES)}") from None


@dataclass(slots=True)
class EngineConfig:
    """Everything the engine needs besides the model directory's own config.json.

    The KV pool is sized from a budget: `num_kv_blocks` exactly, or `kv_cache_memory` bytes
    (default 1GiB). It never grabs "whatever is free".
    """

    model: str
    dtype: str | torch.dtype = "float32"
    device: str = "cpu"
    max_model_len: Annotated[int, Meta(ge=1)] | None = None  # default: the model's max_position_embeddings
    block_size: Annotated[int, Meta(ge=1)] = 16
    max_num_batched_tokens: Annotated[int, Meta(ge=1)] = 2048
    max_num_seqs: Annotated[int, Meta(ge=1)] = 64
    kv_cache_memory: int | str = "1GiB"
    num_kv_blocks: Annotated[int, Meta(ge=2)] | None = None
    enable_prefix_caching: bool = True
    prefix_cache_hash: str | PrefixCacheHash = PrefixCacheHash.SHA256
    scheduling_policy: str | SchedulingPolicy = SchedulingPolicy.FCFS
    seed: Annotated[int, Meta(ge=0)] = 0
    # "auto" (Triton on CUDA, torch on CPU), "torch" or "triton": engine.attention.backend
    attention_backend: str = "auto"
    num_threads: Annotated[int, Meta(ge=1)] | None = None  # torch intra-op threads; None leaves torch's default
    # True when `model` is a directory the caller already opened and verified (the server's
    # extracted archive): the engine loads it as it is, without re-hashing or re-checking it.
    model_verified: bool = False
    # Tiered KV offload through LMCache: {"cpu_size_gb", "disk_path", "disk_size_gb",
    # "chunk_size", "remote_url"} (engine.kv_offload.config); None = off. Normalised (defaults filled) here.
    kv_offload: dict | None = None
    # Speculative decoding: {"method": "ngram", "num_speculative_tokens", "prompt_lookup_max",
    # "prompt_lookup_min"} (engine.spec_decode.config); None = off. Normalised here.
    speculative: dict | None = None
    # Quantized layers (engine.model.quant_spec): None loads the checkpoint as it is (quantized
    # or not); "none", "int8", "int4" or "w8a8" asks for that mode (a quantized checkpoint
    # refuses a different one). quant_group_size: int4's group size (32, 64 or 128).
    quantization: str | None = None
    quant_group_size: int = 32
    # KV cache storage (engine.attention.kv_quant): "auto" (the model dtype), "fp8_e4m3" or "int8"
    # (codes + a bf16 scale per token and KV head: ~half of bf16's bytes, so ~2x the blocks).
    kv_cache_dtype: str = "auto"
    # LoRA adapters (engine.lora): at most max_loras resident per worker (a step runs requests of
    # at most that many adapters; more are swapped in LRU order), each of rank <= max_lora_rank.
    max_loras: Annotated[int, Meta(ge=1)] = 4
    max_lora_rank: Annotated[int, Meta(ge=1)] = 16
    # Schedule and prepare step k+1 while step k's forward runs on a thread of the engine's own
    # (engine.engine_core.EngineCore.step). Output is the same; off by default: 0.71x with 2
    # threads, 0.98x with 1 on a quiet 2-core CPU (benchmarks/results/async_scheduling.unrecorded.md).
    async_scheduling: bool = False
    # Tensor parallelism (engine.parallel): the worker runs as this many processes joined by
    # torch.distributed (gloo on CPU, NCCL on CUDA with one device each), each holding 1/N of
    # the heads, the MLP and the vocabulary. Not combined with quantization, LoRA adapters,
    # KV offload or speculative decoding (refused).
    tensor_parallel_size: Annotated[int, Meta(ge=1, le=MAX_TENSOR_PARALLEL)] = 1
    # torch.compile of the forward (engine.model.compile): "none" (eager), "auto" (compiled only
    # where benchmarks/compile_bench.py measured a gain) or "always"; compiled before the worker
    # says ready (not with tensor parallelism: eager). compile_max_tokens: the largest token
    # bucket compiled (buckets are powers of two; default max_num_batched_tokens, capped by what
    # "auto" measured); bigger steps run eager. compile_cache_dir: inductor's on-disk cache
    # (default <cache>/inductor).
    compile: str | CompileMode = CompileMode.NONE
    compile_max_tokens: Annotated[int, Meta(ge=1)] | None = None
    compile_cache_dir: str | None = None
    torch_dtype: torch.dtype = field(init=False)
    kv_offload_config: KVOffloadConfig | None = field(init=False)
    speculative_config: SpeculativeConfig | None = field(init=False)

    def __post_init__(self) -> None:
        self.torch_dtype = resolve_dtype(self.dtype)
        self.dtype = str(self.torch_dtype).removeprefix("torch.")
        self.kv_cache_memory = parse_size(self.kv_cache_memory)
        self.prefix_cache_hash = _coerce_enum(PrefixCacheHash, "prefix_cache_hash", self.prefix_cache_hash)
        self.scheduling_policy = _coerce_enum(SchedulingPolicy, "scheduling_policy", self.scheduling_policy)
        self.compile = _coerce_enum(CompileMode, "compile", self.compile)
        for name in ("block_size", "max_num_batched_tokens", "max_num_seqs"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ValueError(f"{name} must be a positive integer, got {value!r}")
        if self.block_size & (self.block_size - 1):
            raise ValueError(f"block_size must be a power of two, got {self.block_size}")
        if self.max_model_len is not None and (
            not isinstance(self.max_model_len, int) or self.max_model_len < 1
        ):
            raise ValueError(f"max_model_len must be a positive integer, got {self.max_model_len!r}")
        if self.num_kv_blocks is not None and (
            not isinstance(self.num_kv_blocks, int) or self.num_kv_blocks < 2
        ):
            raise ValueError(f"num_kv_blocks must be an integer >= 2, got {self.num_kv_blocks!r}")
        for name in ("max_loras", "max_lora_rank"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ValueError(f"{name} must be a positive integer, got {value!r}")
        if not isinstance(self.async_scheduling, bool):
            raise ValueError(f"async_scheduling must be true or false, got {self.async_scheduling!r}")
        if self.compile_max_tokens is not None and (
            not isinstance(self.compile_max_tokens, int) or isinstance(self.compile_max_tokens, bool)
            or self.compile_max_tokens < 1
        ):
            raise ValueError(f"compile_max_tokens must be a positive integer, got {self.compile_max_tokens!r}")
        if self.num_threads is not None and self.num_threads < 1:
            raise ValueError(f"num_threads must be >= 1, got {self.num_threads}")
        if self.attention_backend not in BACKEND_NAMES:
            raise ValueError(f"attention_backend must be one of {', '.join(BACKEND_NAMES)}, "
                             f"got {self.attention_backend!r}")
        if not str(self.device).startswith(("cpu", "cuda")):
            raise ValueError(f"device must be 'cpu' or 'cuda[:N]', got {self.device!r}")
        if self.quantization is not None:
            allowed = ("none", "int8", "int4", "w8a8")
            if not isinstance(self.quantization, str) or self.quantization.lower() not in allowed:
                raise ValueError(f"quantization must be one of {', '.join(allowed)}, got {self.quantization!r}")
            self.quantization = self.quantization.lower()
        if self.quant_group_size not in (32, 64, 128) or isinstance(self.quant_group_size, bool):
            raise ValueError(f"quant_group_size must be 32, 64 or 128, got {self.quant_group_size!r}")
        self.kv_cache_dtype = parse_kv_cache_dtype(self.kv_cache_dtype).value
        self._check_tensor_parallel()
        self.kv_offload_config = None
        if self.kv_offload is not None:
            self.kv_offload_config = KVOffloadConfig.from_options(self.kv_offload, self.block_size)
            self.kv_offload = self.kv_offload_config.as_dict()
        self.speculative_config = None
        if self.speculative is not None:
            self.speculative_config = SpeculativeConfig.from_options(self.speculative)
            self.speculative = asdict(self.speculative_config)

    def _check_tensor_parallel(self) -> None:
        size = self.tensor_parallel_size
        if not isinstance(size, int) or isinstance(size, bool) or not 1 <= size <= MAX_TENSOR_PARALLEL:
            raise ValueError(f"tensor_parallel_size must be an integer from 1 to {MAX_TENSOR_PARALLEL}, got {size!r}")
        if size == 1:
            return
        unsupported = [name for name, on in (
            ("quantization", self.quantization not in (None, "none")),
            ("kv_offload", self.kv_offload is not None),
            ("speculative", self.speculative is not None),
        ) if on]
        if unsupported:
            raise ValueError(f"{unsupported[0]} is not supported with tensor_parallel_size={size}; "
                             f"turn it off or use tensor_parallel_size=1")

    def resolve_max_model_len(self, model_max_positions: int) -> int:
        if self.max_model_len is None:
            return model_max_positions
        if self.max_model_len > model_max_positions:
            raise ValueError(
                f"max_model_len={self.max_model_len} exceeds the model's "
                f"max_position_embeddings={model_max_positions}"
            )
        return self.max_model_len

    def resolve_num_blocks(self, bytes_per_block: int) -> int:
        """Number of KV blocks: exact if given, else the memory budget divided by block size."""
        if self.num_kv_blocks is not None:
            return self.num_kv_blocks
        num = self.kv_cache_memory // bytes_per_block
        if num < 2:
            raise ValueError(
                f"kv_cache_memory={self.kv_cache_memory} bytes holds {num} blocks of "
                f"{bytes_per_block} bytes; at least 2 are needed"
            )
        return num
