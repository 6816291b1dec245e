"""Paged decode attention for CPU as a small C++ extension, with its plain-torch reference.

The kernel is part of the native extension (`pagedserve.kernels.cpu_native`, g++ and ninja). Where it
cannot be built, `load_cpu_kernels()` returns None and callers use the torch path.

It also reads a quantized KV cache (`kv_quant` "fp8_e4m3" or "int8"; the format is the engine's
`pagedserve.engine.attention.kv_quant`: uint8 rows of `D + 2` bytes per token and KV head, D codes then a
bf16 scale), de-quantizing in the inner loop; `gather_dequantize` de-quantizes one sequence's rows.
"""

from __future__ import annotations

import torch

from pagedserve.kernels.cpu_native import load_native


def load_cpu_kernels():
    """The native extension (pagedserve.kernels.cpu_native), which has this kernel; None if unavailable."""
    return load_native()


KV_QUANT_KINDS = ("fp8_e4m3", "int8")
KV_SCALE_BYTES = 2


def _check_kv_quant(kv_quant: str | None) -> None:
    if kv_quant is not None and kv_quant not in KV_QUANT_KINDS:
        raise ValueError(f"kv_quant must be one of {', '.join(KV_QUANT_KINDS)} or None, got {kv_quant!r}")


def paged_decode_attention(
    ext,
    query: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,
    seq_lens: torch.Tensor,
    scale: float,
    kv_quant: str | None = None,
    isa: str = "",
) -> torch.Tensor:
    """Launcher: checks and normalises inputs, then runs the extension's kernel (`isa`: "" for
    the CPU's best path, or one of `pagedserve.kernels.cpu_native.ISA_NAMES` to force it).

    query [B, H, D] float32 or bfloat16; k_cache/v_cache [num_blocks, block_size, KVH, D] in
    query's dtype, or with `kv_quant` uint8 [num_blocks, block_size, KVH, D + 2] rows;
    block_tables [B, max_blocks] int32; seq_lens [B] int32. Returns [B, H, D].
    """
    if query.device.type != "cpu":
        raise ValueError("the CPU kernel needs CPU tensors")
    _check_kv_quant(kv_quant)
    cache_dtype = torch.uint8 if kv_quant else query.dtype
    if query.dtype not in (torch.float32, torch.bfloat16) or k_cache.dtype != cache_dtype:
        raise ValueError(f"unsupported dtypes {query.dtype} / {k_cache.dtype} (kv_quant {kv_quant!r})")
    width = query.shape[2] + (KV_SCALE_BYTES if kv_quant else 0)
    if k_cache.shape[3] != width:
        raise ValueError(
            f"cache rows of {k_cache.shape[3]} do not fit head_dim {query.shape[2]} (kv_quant {kv_quant!r})"
        )
    if query.shape[1] % k_cache.shape[2]:
        raise ValueError("num_heads must be a multiple of num_kv_heads")
    return ext.paged_decode_attention(
        query.contiguous(),
        k_cache,
        v_cache,
        block_tables.to(torch.int32),
        seq_lens.to(torch.int32),
        float(scale),
        kv_quant or "",
        isa=isa,
    )


def gather_dequantize(
    ext, cache: torch.Tensor, blocks: torch.Tensor, length: int, kv_quant: str, dtype: torch.dtype
) -> torch.Tensor:
    """Tokens [0, length) of one sequence, de-quantized: cache uint8 [num_blocks, block_size, KVH,
    D + 2], blocks [>= ceil(length / block_size)] -> [length, KVH, D] in `dtype` (float32 or
    bfloat16), every value `code * scale` in float32 rounded once (as `kv_quant.dequantize_kv`)."""
    _check_kv_quant(kv_quant)
    if kv_quant is None or cache.dtype != torch.uint8 or dtype not in (torch.float32, torch.bfloat16):
        raise ValueError(f"unsupported dtypes {cache.dtype} -> {dtype} (kv_quant {kv_quant!r})")
    out = torch.empty(length, cache.shape[2], cache.shape[3] - KV_SCALE_BYTES, dtype=dtype)
    ext.gather_dequantize(cache, blocks.to(torch.int32).contiguous(), out, kv_quant)
    return out


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
