"""Engine configuration: one msgspec Struct with its constraints declared on the fields.

The declaration (`EngineFields`) is what `EngineConfig(...)`, `LLM(**options)` and
model-config.yaml's `handler:` section are checked against (pagedserve.engine.model.model_config derives the
section from it: a new field is a new key there), and what the configuration reference in the
docs is generated from: a field's comment is its documentation. Only rules that tie fields
together are written by hand (`__post_init__`). Importing this module does not import torch.
"""

from __future__ import annotations

import enum
import re
from typing import TYPE_CHECKING, Annotated, Any, Literal, cast

import msgspec
from msgspec import Meta

from pagedserve.engine.config.kv_offload import KVOffloadConfig
from pagedserve.engine.config.schema import SchemaError, check_fields
from pagedserve.engine.kv_cache.hashing import PrefixCacheHash

if TYPE_CHECKING:
    import torch

    from pagedserve.engine.config.speculative import SpeculativeConfig


class SchedulingPolicy(enum.Enum):
    FCFS = "fcfs"
    PRIORITY = "priority"


class CompileMode(enum.Enum):
    """torch.compile of the forward (pagedserve.engine.model.compile)."""

    NONE = "none"
    AUTO = "auto"
    ALWAYS = "always"


DTypeName = Literal["float32", "fp32", "bfloat16", "bf16", "float16", "fp16"]

# dtype names -> torch's attribute name (the canonical name EngineConfig keeps)
_DTYPES: dict[str, DTypeName] = {
    "float32": "float32",
    "fp32": "float32",
    "bfloat16": "bfloat16",
    "bf16": "bfloat16",
    "float16": "float16",
    "fp16": "float16",
}

MAX_TENSOR_PARALLEL = 64  # ranks of one worker

SIZE_PATTERN = r"^\s*(\d+(?:\.\d+)?)\s*([KMGTkmgt]i?[Bb]|[Bb])?\s*$"
_SIZE_RE = re.compile(SIZE_PATTERN)
_SIZE_UNITS = {
    "b": 1,
    "kb": 10**3,
    "mb": 10**6,
    "gb": 10**9,
    "tb": 10**12,
    "kib": 2**10,
    "mib": 2**20,
    "gib": 2**30,
    "tib": 2**40,
}
Size = (
    Annotated[int, Meta(ge=1)]
    | Annotated[str, Meta(pattern=SIZE_PATTERN, extra={"expected": "a size such as 2GiB, 512MiB or a byte count"})]
)
_Positive = Annotated[int, Meta(ge=1)]


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


_DTYPE_BYTES = {"float32": 4, "bfloat16": 2, "float16": 2}


def _dtype_name(value: Any) -> str:
    """The canonical name (torch's attribute) of a dtype name; ValueError naming the choices."""
    try:
        return _DTYPES[str(value).lower()]
    except KeyError:
        raise ValueError(f"unsupported dtype {value!r}: choose one of {sorted(_DTYPES)}") from None


def dtype_itemsize(value: Any) -> int:
    """Bytes of one element of a dtype name (or a torch.dtype); a name needs no torch."""
    if not isinstance(value, str):
        return resolve_dtype(value).itemsize
    return _DTYPE_BYTES[_dtype_name(value)]


def resolve_dtype(value: Any) -> torch.dtype:
    """A dtype name (or a torch.dtype) -> the torch.dtype; imports torch."""
    import torch

    if isinstance(value, torch.dtype):
        if value not in (torch.float32, torch.bfloat16, torch.float16):
            raise ValueError(f"unsupported dtype {value}")
        return value
    return getattr(torch, _dtype_name(value))


class EngineFields(msgspec.Struct, forbid_unknown_fields=True):
    """Everything the engine needs besides the model directory's own config.json.

    The KV pool is sized from a budget: `num_kv_blocks` exactly, or `kv_cache_memory` bytes
    (default 1GiB). It never grabs "whatever is free".
    """

    model: str  # the model directory or archive
    dtype: DTypeName = "float32"  # the weights' and activations' dtype
    device: Annotated[str, Meta(pattern=r"^(cpu|cuda(:\d+)?)$", extra={"expected": "cpu or cuda[:N]"})] = "cpu"
    # CUDA_VISIBLE_DEVICES of the worker process (set by the server per worker: its GPUs, seen
    # as cuda:0..N-1 inside); None: inherited.
    visible_devices: str | None = None
    max_model_len: _Positive | None = None  # default: the model's max_position_embeddings
    block_size: Annotated[int, Meta(ge=1, le=1024)] = 16  # tokens per KV block; a power of two
    max_num_batched_tokens: _Positive = 2048  # the scheduler's token budget per step
    max_num_seqs: _Positive = 64  # requests running at once
    kv_cache_memory: Size = "1GiB"  # the KV pool's size: bytes, or a size such as "512MiB"
    num_kv_blocks: Annotated[int, Meta(ge=2)] | None = None  # the KV pool's size in blocks (wins over kv_cache_memory)
    enable_prefix_caching: bool = True
    # Layers grouped by attention kind, sliding-window groups returning the blocks their window
    # left (pagedserve.engine.kv_cache.groups); off by itself with tensor parallelism or KV offload.
    hybrid_kv_cache: bool = True
    prefix_cache_hash: PrefixCacheHash = PrefixCacheHash.SHA256  # the block hash of the prefix cache
    scheduling_policy: SchedulingPolicy = SchedulingPolicy.FCFS
    seed: Annotated[int, Meta(ge=0)] = 0
    # "auto" (Triton on CUDA, torch on CPU), "torch" or "triton": pagedserve.engine.attention.selector
    attention_backend: Literal["auto", "torch", "triton"] = "auto"
    num_threads: _Positive | None = None  # torch intra-op threads; None leaves torch's default
    # True when `model` is a directory the caller already opened and verified (the server's
    # extracted archive): the engine loads it as it is, without re-hashing or re-checking it.
    model_verified: bool = False
    # Tiered KV offload through LMCache (pagedserve.engine.config.kv_offload); None = off.
    kv_offload: KVOffloadConfig | None = None
    # Speculative decoding: {"method": "ngram" | "suffix" | "auto", "num_speculative_tokens", ...}
    # (pagedserve.engine.config.speculative.SpeculativeConfig); None = off.
    speculative: dict[str, Any] | None = None
    # Quantized layers (pagedserve.engine.model.quant_spec): None loads the checkpoint as it is (quantized
    # or not); "none", "int8", "int4" or "w8a8" asks for that mode (a quantized checkpoint
    # refuses a different one).
    quantization: Literal["none", "int8", "int4", "w8a8"] | None = None
    quant_group_size: Literal[32, 64, 128] = 32  # int4's group size
    # KV cache storage (pagedserve.engine.attention.kv_quant): "auto" (the model dtype), "fp8_e4m3" or "int8"
    # (codes + a bf16 scale per token and KV head: ~half of bf16's bytes, so ~2x the blocks).
    kv_cache_dtype: Literal["auto", "fp8_e4m3", "int8"] = "auto"
    # LoRA adapters (pagedserve.engine.lora): at most max_loras resident per worker (a step runs requests of
    # at most that many adapters; more are swapped in LRU order), each of rank <= max_lora_rank.
    max_loras: _Positive = 4
    max_lora_rank: _Positive = 16
    # Schedule and prepare step k+1 while step k's forward runs on a thread of the engine's own
    # (pagedserve.engine.core.engine_core.EngineCore.step). Output is the same; off by default: 0.71x with 2
    # threads, 0.98x with 1 on a quiet 2-core CPU (benchmarks/async_scheduling.py; docs/concepts/engine-step.md).
    async_scheduling: bool = False
    # Tensor parallelism (pagedserve.engine.parallel): the worker runs as this many processes joined by
    # torch.distributed (gloo on CPU, NCCL on CUDA with one device each), each holding 1/N of
    # the heads, the MLP and the vocabulary. Not combined with quantization, KV offload or
    # speculative decoding (refused).
    tensor_parallel_size: Annotated[int, Meta(ge=1, le=MAX_TENSOR_PARALLEL)] = 1
    # torch.compile of the forward (pagedserve.engine.model.compile): "none" (eager), "auto" (compiled only
    # where benchmarks/compile_bench.py measured a gain) or "always"; compiled before the worker
    # says ready (not with tensor parallelism: eager).
    compile: CompileMode = CompileMode.NONE
    # The largest token bucket compiled (buckets are powers of two; default
    # max_num_batched_tokens, capped by what "auto" measured); bigger steps run eager.
    compile_max_tokens: _Positive | None = None
    compile_cache_dir: str | None = None  # inductor's on-disk cache (default <cache>/inductor)
    # Batch-invariant kernels (docs/batch-invariance.md): a request's tokens do not depend on
    # what shares its steps, on chunked prefill or on prefix-cache and KV offload hits (every
    # GEMM on fixed row tiles, every query token attended alone). Costs throughput; not with
    # compile, tensor parallelism, quantization or the triton backend.
    batch_invariant: bool = False


class EngineConfig(EngineFields):
    """The engine's settings, checked against their declaration when built (a `SchemaError`,
    a ValueError, naming the field), with names normalised: `dtype` is torch's name,
    `kv_cache_memory` bytes, enums their members, `kv_offload` a `KVOffloadConfig`."""

    def __post_init__(self) -> None:
        if type(self.dtype).__name__ == "dtype":  # a torch.dtype given in Python
            self.dtype = cast(DTypeName, str(self.dtype).removeprefix("torch."))  # checked below
        for name in ("dtype", "quantization", "kv_cache_dtype"):
            value = getattr(self, name)
            if isinstance(value, str):
                setattr(self, name, value.lower())  # checked below
        checked = check_fields(self, EngineFields)
        for field in msgspec.structs.fields(EngineFields):
            setattr(self, field.name, getattr(checked, field.name))
        self.dtype = _DTYPES[self.dtype]
        self.kv_cache_memory = parse_size(self.kv_cache_memory)
        if self.block_size & (self.block_size - 1):
            raise SchemaError(f"block_size: must be a power of two, got {self.block_size}", "block_size")
        self._check_tensor_parallel()
        self._check_batch_invariant()
        if self.kv_offload is not None and self.kv_offload.chunk_size % self.block_size:
            raise SchemaError(
                f"kv_offload.chunk_size: must be a multiple of block_size={self.block_size}, "
                f"got {self.kv_offload.chunk_size}",
                "kv_offload.chunk_size",
            )
        if self.speculative is not None:
            from pagedserve.engine.config.speculative import SpeculativeConfig

            self.speculative = SpeculativeConfig.from_options(self.speculative).as_dict()

    @property
    def torch_dtype(self) -> torch.dtype:
        return resolve_dtype(self.dtype)

    @property
    def kv_offload_config(self) -> KVOffloadConfig | None:
        return self.kv_offload

    @property
    def speculative_config(self) -> SpeculativeConfig | None:
        if self.speculative is None:
            return None
        from pagedserve.engine.config.speculative import SpeculativeConfig

        return SpeculativeConfig.from_options(self.speculative)

    def _check_tensor_parallel(self) -> None:
        size = self.tensor_parallel_size
        if size == 1:
            return
        unsupported = [
            name
            for name, on in (
                ("quantization", self.quantization not in (None, "none")),
                ("kv_offload", self.kv_offload is not None),
                ("speculative", self.speculative is not None),
            )
            if on
        ]
        if unsupported:
            raise SchemaError(
                f"{unsupported[0]}: is not supported with tensor_parallel_size={size}; "
                f"turn it off or use tensor_parallel_size=1",
                unsupported[0],
            )

    def _check_batch_invariant(self) -> None:
        if not self.batch_invariant:
            return
        conflicts = (
            ("compile", self.compile is not CompileMode.NONE),
            ("tensor_parallel_size", self.tensor_parallel_size > 1),
            ("quantization", self.quantization not in (None, "none")),
            ("attention_backend", self.attention_backend == "triton"),
        )
        for name, on in conflicts:
            if on:
                value = getattr(self, name)
                value = getattr(value, "value", value)  # an enum: its name in the config
                raise SchemaError(f"{name}: is not supported with batch_invariant, got {value!r}", name)

    def resolve_max_model_len(self, model_max_positions: int) -> int:
        if self.max_model_len is None:
            return model_max_positions
        if self.max_model_len > model_max_positions:
            raise ValueError(
                f"max_model_len={self.max_model_len} exceeds the model's max_position_embeddings={model_max_positions}"
            )
        return self.max_model_len

    def resolve_num_blocks(self, bytes_per_block: int) -> int:
        """Number of KV blocks: exact if given, else the memory budget divided by block size."""
        if self.num_kv_blocks is not None:
            return self.num_kv_blocks
        num = parse_size(self.kv_cache_memory) // bytes_per_block
        if num < 2:
            raise ValueError(
                f"kv_cache_memory={self.kv_cache_memory} bytes holds {num} blocks of "
                f"{bytes_per_block} bytes; at least 2 are needed"
            )
        return num
