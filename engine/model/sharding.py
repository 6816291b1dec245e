"""How a model is cut among tensor-parallel ranks, and each rank's read of its slices.

Rank r of N holds (as vLLM does):
- query heads `[r*H/N, (r+1)*H/N)` of q_proj (rows) and of o_proj (columns);
- KV heads `[r*K/N, (r+1)*K/N)` of k_proj / v_proj when N <= K; when N > K, one KV head,
  `r*K // N`, replicated on the N/K ranks whose query heads use it;
- rows `[r*I/N, (r+1)*I/N)` of gate_proj and up_proj, the same columns of down_proj;
- rows `[r*V/N, (r+1)*V/N)` of the embedding and of an untied LM head (the vocabulary);
- mixture of experts: every expert, each cut like the MLP by its own intermediate size E
  (rows `[r*E/N, (r+1)*E/N)` of its gate/up, those columns of its down), the shared expert
  likewise; the router and the shared expert's gate whole (every rank routes every token);
- a checkpoint that fuses them (Phi-3's `qkv_proj`, `gate_up_proj`): the same slices of each
  part, read from the fused tensor and concatenated (q|k|v, gate|up);
- per-head q/k norms (Qwen3, Gemma 3) whole: every head shares them; q/k norms over whole
  projections (OLMoE) sliced like q_proj / k_proj rows, their mean of squares all-reduced
  (pagedserve.engine.model.layers.parallel.SplitRMSNorm) — so KV heads cannot be replicated there;
- the other norms whole. A row-parallel bias (o_proj, down_proj) is added once: rank 0 holds it,
  the other ranks zeros, so the all-reduce of the partial outputs adds it exactly once.

Sizes that do not divide are refused up front by `check_tensor_parallel`, naming them. Each
rank reads only its slices from the safetensors files (`safe_open(...).get_slice`), never a
whole projection.
"""

from __future__ import annotations

import dataclasses
import re
from collections.abc import Iterator
from pathlib import Path
from typing import TYPE_CHECKING

from safetensors import safe_open

from pagedserve.engine.model.spec import ModelSpec

if TYPE_CHECKING:
    import torch

_LAYER_TENSOR = re.compile(r"^model\.layers\.\d+\.(self_attn|mlp)\.(\w+)\.(weight|bias)$")
# An expert's projection (Qwen / OLMoE names, and Mixtral's w1 = gate, w3 = up, w2 = down).
_EXPERT_TENSOR = re.compile(
    r"^model\.layers\.\d+\.(?:mlp|block_sparse_moe)\.(experts\.\d+|shared_expert)\."
    r"(gate_proj|up_proj|w1|w3|down_proj|w2)\.weight$"
)
_VOCAB_TENSORS = ("model.embed_tokens.weight", "lm_head.weight")


def check_tensor_parallel(spec: ModelSpec, size: int) -> None:
    """ValueError naming every model size that `size` ranks cannot share evenly."""
    if size == 1:
        return
    problems = []
    if spec.num_heads % size:
        problems.append(f"{spec.num_heads} query heads")
    kv = spec.num_kv_heads
    if kv >= size and kv % size:
        problems.append(f"{kv} KV heads")
    if kv < size and size % kv:
        problems.append(
            f"{kv} KV heads (with fewer KV heads than ranks, the ranks must be a "
            f"multiple of them: each KV head is replicated on tensor_parallel_size / KV heads ranks)"
        )
    if kv < size and spec.qk_norm_full:
        problems.append(
            f"{kv} KV heads (the k norm of {spec.architecture} spans all KV heads: each rank needs a share of them, "
            "none replicated)"
        )
    if spec.intermediate_size % size:
        problems.append(f"MLP intermediate size {spec.intermediate_size}")
    if spec.moe is not None:
        if spec.moe.intermediate_size % size:
            problems.append(f"expert intermediate size {spec.moe.intermediate_size}")
        if spec.moe.shared_intermediate_size % size:
            problems.append(f"shared expert intermediate size {spec.moe.shared_intermediate_size}")
    if spec.vocab_size % size:
        problems.append(f"vocabulary of {spec.vocab_size} tokens")
    if problems:
        raise ValueError(
            f"tensor_parallel_size={size} does not divide the model's "
            f"{', '.join(problems)}; choose a size that divides them"
        )


def shard_spec(spec: ModelSpec, size: int) -> ModelSpec:
    """The sizes one of `size` ranks holds (checked first): its query and KV heads, its part of
    the MLP and of the vocabulary. Hidden size, layers and head size are the model's."""
    check_tensor_parallel(spec, size)
    moe = spec.moe
    if moe is not None:  # every rank holds every expert, a slice of each (pagedserve.engine.model.layers.moe)
        moe = dataclasses.replace(
            moe,
            intermediate_size=moe.intermediate_size // size,
            shared_intermediate_size=moe.shared_intermediate_size // size,
        )
    return dataclasses.replace(
        spec,
        num_heads=spec.num_heads // size,
        num_kv_heads=max(1, spec.num_kv_heads // size),
        intermediate_size=spec.intermediate_size // size,
        vocab_size=spec.vocab_size // size,
        moe=moe,
    )


@dataclasses.dataclass(frozen=True, slots=True)
class TensorSlice:
    """The part of one checkpoint tensor a rank holds: `length` entries of dimension `dim` from
    `start` (the whole tensor has `full` there), or (`zeros`) a zero tensor of its shape."""

    dim: int = 0
    start: int = 0
    length: int = 0
    full: int = 0
    zeros: bool = False
    # A fused tensor (dimension 0): the rank's rows are these (start, length) ranges, concatenated.
    segments: tuple[tuple[int, int], ...] = ()


def tensor_slice(name: str, spec: ModelSpec, rank: int, size: int) -> TensorSlice | None:
    """What rank `rank` of `size` holds of the HF tensor `name`; None: the whole tensor."""
    local = shard_spec(spec, size)
    if name in _VOCAB_TENSORS:
        return TensorSlice(0, rank * local.vocab_size, local.vocab_size, spec.vocab_size)
    expert = _EXPERT_TENSOR.match(name)
    if expert is not None:
        moe = spec.moe
        if moe is None:
            raise ValueError(f"{name}: an expert's tensor in a model without experts")
        full = moe.shared_intermediate_size if expert.group(1) == "shared_expert" else moe.intermediate_size
        width = full // size
        return TensorSlice(1 if expert.group(2) in ("down_proj", "w2") else 0, rank * width, width, full)
    match = _LAYER_TENSOR.match(name)
    if match is None:
        return None  # norms (and anything load_weights will refuse by name)
    proj, leaf = match.group(2), match.group(3)
    d = spec.head_dim
    q_rows = (rank * local.num_heads * d, local.num_heads * d)
    first = rank * spec.num_kv_heads // size  # replicated heads: ranks share one
    kv_rows = (first * d, local.num_kv_heads * d)
    q_full, kv_full = spec.num_heads * d, spec.num_kv_heads * d
    mlp_rows = (rank * local.intermediate_size, local.intermediate_size)
    if proj == "q_proj" or (proj == "q_norm" and spec.qk_norm_full):
        return TensorSlice(0, *q_rows, q_full)
    if proj in ("k_proj", "v_proj") or (proj == "k_norm" and spec.qk_norm_full):
        return TensorSlice(0, *kv_rows, kv_full)
    if proj in ("gate_proj", "up_proj"):
        return TensorSlice(0, *mlp_rows, spec.intermediate_size)
    if proj == "qkv_proj":  # fused q|k|v (Phi-3)
        qkv: tuple[tuple[int, int], ...] = (
            q_rows,
            (q_full + kv_rows[0], kv_rows[1]),
            (q_full + kv_full + kv_rows[0], kv_rows[1]),
        )
        return TensorSlice(0, full=q_full + 2 * kv_full, segments=qkv)
    if proj == "gate_up_proj":  # fused gate|up (Phi-3)
        segments = (mlp_rows, (spec.intermediate_size + mlp_rows[0], mlp_rows[1]))
        return TensorSlice(0, full=2 * spec.intermediate_size, segments=segments)
    if proj in ("o_proj", "down_proj"):
        if leaf == "bias":
            return None if rank == 0 else TensorSlice(zeros=True)
        width, full = (
            (local.num_heads * d, spec.num_heads * d)
            if proj == "o_proj"
            else (local.intermediate_size, spec.intermediate_size)
        )
        return TensorSlice(1, rank * width, width, full)
    return None


def iter_rank_tensors(files: list[Path], spec: ModelSpec, rank: int, size: int) -> Iterator[tuple[str, torch.Tensor]]:
    """Like pagedserve.engine.model.loader.iter_safetensors, but only this rank's slice of each tensor is
    read from disk."""
    import torch

    for path in files:
        with safe_open(str(path), framework="pt", device="cpu") as f:
            for name in f.keys():
                part = tensor_slice(name, spec, rank, size)
                if part is None:
                    yield name, f.get_tensor(name)
                elif part.zeros:
                    yield name, torch.zeros_like(f.get_tensor(name))
                else:
                    view = f.get_slice(name)
                    shape = view.get_shape()
                    if len(shape) <= part.dim or shape[part.dim] != part.full:
                        # The rank's slice alone could fit: check the whole tensor's size.
                        raise ValueError(
                            f"tensor {name} has shape {tuple(shape)}, expected {part.full} along dimension {part.dim}"
                        )
                    if part.segments:
                        yield name, torch.cat([view[start : start + n] for start, n in part.segments])
                        continue
                    stop = part.start + part.length
                    yield name, view[part.start : stop] if part.dim == 0 else view[:, part.start : stop]
