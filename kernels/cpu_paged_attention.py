"""Paged decode attention for CPU as a small C++ extension, with its plain-torch reference.

The extension is compiled once per machine by `kernels.cpu_build` (g++ and ninja). Where it
cannot be built, `load_cpu_kernels()` returns None and callers use the torch path.
"""

from __future__ import annotations

from pathlib import Path

import torch

from kernels.cpu_build import CpuExtension

_SOURCE = Path(__file__).resolve().parent / "csrc" / "paged_decode_attention.cpp"
# -fopenmp makes at::parallel_for use torch's thread pool (same libgomp, already loaded).
_CFLAGS = ("-O3", "-march=native", "-ffast-math", "-fopenmp")
EXTENSION = CpuExtension("paged_decode", _SOURCE, _CFLAGS)


def load_cpu_kernels():
    """Compile (first call on a machine, ~30-60 s) or load the extension; None if unavailable."""
    return EXTENSION.load()


def paged_decode_attention(
    ext,
    query: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,
    seq_lens: torch.Tensor,
    scale: float,
) -> torch.Tensor:
    """Launcher: checks and normalises inputs, then runs the extension's kernel.

    query [B, H, D]; k_cache/v_cache [num_blocks, block_size, KVH, D]; block_tables [B, max_blocks]
    int32; seq_lens [B] int32. Returns [B, H, D].
    """
    if query.device.type != "cpu":
        raise ValueError("the CPU kernel needs CPU tensors")
    if query.dtype not in (torch.float32, torch.bfloat16) or k_cache.dtype != query.dtype:
        raise ValueError(f"unsupported dtypes {query.dtype} / {k_cache.dtype}")
    if query.shape[1] % k_cache.shape[2]:
        raise ValueError("num_heads must be a multiple of num_kv_heads")
    return ext.paged_decode_attention(
        query.contiguous(), k_cache, v_cache,
        block_tables.to(torch.int32), seq_lens.to(torch.int32), float(scale),
    )


def reference_paged_decode_attention(
    query: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,
    seq_lens: torch.Tensor,
    scale: float,
) -> torch.Tensor:
    """Plain torch, one sequence at a time, float32 math."""
    batch, num_heads, head_dim = query.shape
    block_size, num_kv_heads = k_cache.shape[1], k_cache.shape[2]
    group = num_heads // num_kv_heads
    out = torch.empty_like(query)
    for b in range(batch):
        length = int(seq_lens[b])
        blocks = block_tables[b, : (length + block_size - 1) // block_size].long()
        k = k_cache[blocks].reshape(-1, num_kv_heads, head_dim)[:length].float()
        v = v_cache[blocks].reshape(-1, num_kv_heads, head_dim)[:length].float()
        k = k.repeat_interleave(group, dim=1)  # [L, H, D]
        v = v.repeat_interleave(group, dim=1)
        scores = torch.einsum("hd,lhd->hl", query[b].float(), k) * scale
        out[b] = torch.einsum("hl,lhd->hd", scores.softmax(-1), v).to(query.dtype)
    return out
