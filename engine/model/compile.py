"""A torch.compile'd forward of the model (inductor, C++ codegen on CPU), bucketed and cached.

`compile` (EngineConfig, model-config.yaml's `handler:` key, `LLM(compile=...)`):

- "none": eager, always.
- "auto": compiled only where benchmarks/compile_bench.py measured a gain on this kind of
  machine (`AUTO_POLICY`); elsewhere eager. See benchmarks/results/compile.xeon.md.
- "always": compiled for every bucket (for benchmarks and parity tests).

How: the attention of each layer is one opaque custom op (pagedserve.engine.attention.compiled_op), so the
graph is split there and attention runs in the eager backend; the glue and matmuls between
attention calls are compiled. A step's token count is padded up to a bucket (powers of two up to
`max_num_batched_tokens`, and that maximum itself), one static-shape graph per bucket, so the
number of compiles is bounded; steps with more tokens than the largest compiled bucket, or with
LoRA adapters, run eagerly. Every bucket is compiled by `warm_up()`, which the model runner calls
before the engine reports ready. Compiled code is cached on disk by inductor's FX graph cache
(`compile_cache_dir`, default `<cache>/inductor`), so a second start reuses it. Models with
sliding windows, soft-capping or mixture-of-experts MLPs (whose per-expert segments are data)
always run eagerly.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

import torch

from pagedserve.engine.attention.backend import AttentionBackend
from pagedserve.engine.attention.compiled_op import AttentionStep, paged_attention_op
from pagedserve.engine.attention.metadata import AttentionMetadata
from pagedserve.engine.config.engine import CompileMode, EngineConfig

if TYPE_CHECKING:
    from pagedserve.engine.model.causal_lm import CausalLM

logger = logging.getLogger(__name__)


@dataclass(frozen=True, slots=True)
class AutoPolicy:
    """Which steps `compile: auto` compiles: dtypes and the largest token bucket (0: none)."""

    max_tokens: dict[torch.dtype, int]

    def largest_bucket(self, dtype: torch.dtype, device: torch.device) -> int:
        return self.max_tokens.get(dtype, 0) if device.type == "cpu" else 0


# Measured in benchmarks/results/compile.xeon.md (2-core Xeon without bf16 dot products, SmolLM2-135M,
# a busy machine): no case gained consistently, so "auto" stays eager everywhere. A measured gain
# is an entry here, e.g. {torch.float32: 16} compiles float32 steps of up to 16 tokens.
AUTO_POLICY = AutoPolicy({})

# Dynamo keeps compiled graphs per code object, and every CompiledForward shares `_forward`'s:
# one graph per bucket and instance. Its default limit of 8 would fall back to eager past that.
_RECOMPILE_LIMIT = 64


def token_buckets(max_num_batched_tokens: int, largest: int | None = None) -> tuple[int, ...]:
    """Powers of two from 1 up to `largest` (default and cap: `max_num_batched_tokens`), and
    the cap itself when it is not a power of two and `largest` reaches it."""
    cap = max_num_batched_tokens if largest is None else min(largest, max_num_batched_tokens)
    buckets = [1 << i for i in range(cap.bit_length()) if 1 << i <= cap]
    if cap == max_num_batched_tokens and buckets[-1] != cap:
        buckets.append(cap)
    return tuple(buckets)


def default_cache_dir() -> Path:
    """`<PAGEDSERVE_CACHE_DIR or ~/.cache/pagedserve>/inductor`."""
    from pagedserve.engine.model import default_model

    return default_model.default_cache_dir() / "inductor"


class CompiledForward:
    """`model(input_ids, positions, kv_caches, meta)` through one compiled graph per bucket.

    Call `warm_up(kv_caches)` once before serving; `covers(num_tokens, lora)` says whether a
    step takes the compiled path, `__call__` runs it (hidden states of the real rows only).
    """

    def __init__(
        self, model: CausalLM, backend: AttentionBackend, buckets: Sequence[int], cache_dir: str | Path | None = None
    ) -> None:
        if not buckets:
            raise ValueError("CompiledForward needs at least one bucket")
        paged_attention_op()  # registered before anything is traced
        self.model = model
        self.backend = backend
        self.buckets = tuple(sorted(buckets))
        self.cache_dir = Path(cache_dir) if cache_dir is not None else default_cache_dir()
        # freezing: the weights become constants of each graph, so inductor can pack them for its
        # own matmul kernels (a packed copy per bucket: memory grows with the bucket count).
        self._compiled = torch.compile(self._forward, dynamic=False, fullgraph=True, options={"freezing": True})
        self.warm = False

    def _forward(
        self, input_ids: torch.Tensor, positions: torch.Tensor, kv_caches: list[torch.Tensor], step: AttentionStep
    ) -> torch.Tensor:
        return self.model(input_ids, positions, kv_caches, step)

    def bucket(self, num_tokens: int) -> int | None:
        """The smallest bucket holding `num_tokens`, None past the largest."""
        return next((b for b in self.buckets if b >= num_tokens), None)

    def covers(self, num_tokens: int, lora: object | None = None) -> bool:
        """Whether a step of `num_tokens` (with LoRA adapters `lora`) runs compiled."""
        return lora is None and self.bucket(num_tokens) is not None

    def __call__(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        kv_caches: list[torch.Tensor],
        meta: AttentionMetadata,
        lora: object | None = None,
    ) -> torch.Tensor:
        if lora is not None:
            raise ValueError("the compiled forward runs the base model only (no LoRA adapters)")
        n = input_ids.shape[0]
        size = self.bucket(n)
        if size is None:
            raise ValueError(f"{n} tokens exceed the largest compiled bucket {self.buckets[-1]}")
        if size != n:
            input_ids = torch.nn.functional.pad(input_ids, (0, size - n))
            positions = torch.nn.functional.pad(positions, (0, size - n))
        with torch._dynamo.config.patch(recompile_limit=_RECOMPILE_LIMIT):
            hidden = self._compiled(input_ids, positions, kv_caches, AttentionStep(self.backend, meta))
        return hidden[:n]

    def warm_up(self, kv_caches: list[torch.Tensor]) -> None:
        """Compile (or load from the disk cache) every bucket's graph. Runs steps of padding
        only: nothing is written to the KV cache."""
        from torch._inductor.runtime.cache_dir_utils import temporary_cache_dir

        self.cache_dir.mkdir(parents=True, exist_ok=True)
        device = kv_caches[0].device if kv_caches else self.model.device
        empty = AttentionMetadata(
            num_seqs=0,
            num_tokens=0,
            query_lens=[],
            seq_lens=[],
            query_start_loc=torch.zeros(1, dtype=torch.int32, device=device),
            seq_lens_tensor=torch.zeros(0, dtype=torch.int32, device=device),
            block_tables=torch.zeros(0, 1, dtype=torch.int32, device=device),
            slot_mapping=torch.zeros(0, dtype=torch.int64, device=device),
            max_query_len=0,
            max_seq_len=0,
            num_decodes=0,
        )
        with temporary_cache_dir(str(self.cache_dir)), torch.inference_mode():
            for size in self.buckets:
                ids = torch.zeros(size, dtype=torch.int64, device=device)
                with torch._dynamo.config.patch(recompile_limit=_RECOMPILE_LIMIT):
                    self._compiled(ids, ids.clone(), kv_caches, AttentionStep(self.backend, empty))
        self.warm = True


def compile_buckets(config: EngineConfig, dtype: torch.dtype, device: torch.device) -> tuple[int, ...]:
    """The token buckets `config.compile` compiles for a model of `dtype` on `device`; empty
    where it stays eager ("none"; tensor parallelism, whose model is not compiled; "auto" where
    AUTO_POLICY has no bucket for this dtype and device, or for a quantized model, which was not
    measured)."""
    if config.compile is CompileMode.NONE or config.tensor_parallel_size > 1:
        return ()
    largest = config.compile_max_tokens or config.max_num_batched_tokens
    if config.compile is CompileMode.AUTO:
        if config.quantization not in (None, "none"):
            return ()
        largest = min(largest, AUTO_POLICY.largest_bucket(dtype, device))
        if not largest:
            return ()
    return token_buckets(config.max_num_batched_tokens, largest)


def compiled_forward_for(
    config: EngineConfig,
    model: CausalLM,
    backend: AttentionBackend,
    kv_caches: list[torch.Tensor],
    buckets: Sequence[int],
) -> CompiledForward | None:
    """The engine's compiled forward over `buckets` (compile_buckets), warmed up; None for none."""
    if not buckets or model.spec.needs_plain_attention:  # windows / soft-caps: not in the compiled op
        return None
    if model.spec.moe is not None:  # experts' segment sizes are data (pagedserve.engine.model.layers.moe): eager
        return None
    compiled = CompiledForward(model, backend, buckets, config.compile_cache_dir)
    start = time.perf_counter()
    compiled.warm_up(kv_caches)
    logger.info(
        "compiled the forward for %d token buckets (%s) in %.1f s",
        len(buckets),
        ", ".join(map(str, buckets)),
        time.perf_counter() - start,
    )
    return compiled
