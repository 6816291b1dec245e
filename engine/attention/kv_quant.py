"""Quantized KV cache: the `kv_cache_dtype` option (`auto | fp8_e4m3 | int8`).

`auto` keeps keys and values in the model dtype. The two quantized kinds store each token's
key (or value) of one KV head as one row of bytes in the same paged tensor the engine always
uses, `[2, num_blocks, block_size, kv_heads, width]`, now uint8 with `width = head_dim + 2`:

    bytes 0 .. head_dim-1   the codes: float8 e4m3 (fp8_e4m3) or int8 (int8), one per element
    bytes head_dim, +1      the row's scale, one bfloat16 (little-endian), `x ~ code * scale`

so the scale is per token and per KV head (written once with its token: a block that fills up
over many steps never needs re-scaling), and everything that moves KV blocks (prefix caching,
the offload tiers) moves the scales with them. Scale = max |x| of the row / the code's largest
value (448 for e4m3, 127 for int8), rounded to bf16 before the codes are computed; codes are
clamped to that range. Memory: 66 bytes per 64-element row instead of 128 in bf16 (256 in
float32), so a pool sized from the same budget holds 1.94x (3.9x) the blocks.

Round-trip error per element, relative to the row's max |x|: int8 <= 1/254 (+ bf16 rounding
of the scale, 2^-9); e4m3 <= 2^-4 of the element itself (3 mantissa bits), plus the same.

The same layout is read, without this module, by the compiled CPU kernels
(`kernels/csrc/paged_decode_attention.cpp`: decode attention and a gather + de-quantize pass,
tested bit-exact against `dequantize_kv`) and by the Triton kernel; a change here changes them.
"""

from __future__ import annotations

import torch

from pagedserve.engine.attention.kv_dtype import SCALE_BYTES, KVCacheDtype

_CODE_MAX = {KVCacheDtype.FP8_E4M3: 448.0, KVCacheDtype.INT8: 127.0}


def kv_storage_dtype(kind: KVCacheDtype, model_dtype: torch.dtype) -> torch.dtype:
    return torch.uint8 if kind.quantized else model_dtype


def quantize_kv(x: torch.Tensor, kind: KVCacheDtype) -> torch.Tensor:
    """`x [..., head_dim]` (any float dtype) -> uint8 rows `[..., head_dim + 2]` (codes, bf16 scale)."""
    code_max = _CODE_MAX[kind]
    xf = x.float()
    scale = (xf.abs().amax(dim=-1, keepdim=True) / code_max).clamp_min(1e-30).to(torch.bfloat16)
    scaled = (xf / scale.float()).clamp_(-code_max, code_max)
    if kind is KVCacheDtype.FP8_E4M3:
        codes = scaled.to(torch.float8_e4m3fn).view(torch.uint8)
    else:
        codes = scaled.round_().to(torch.int8).view(torch.uint8)
    return torch.cat((codes, scale.view(torch.uint8)), dim=-1)


def dequantize_kv(rows: torch.Tensor, kind: KVCacheDtype, dtype: torch.dtype) -> torch.Tensor:
    """uint8 rows `[..., head_dim + 2]` -> values `[..., head_dim]` in `dtype` (float32 math)."""
    head_dim = rows.shape[-1] - SCALE_BYTES
    scale = rows[..., head_dim:].contiguous().view(torch.bfloat16).float()
    codes = rows[..., :head_dim].view(torch.float8_e4m3fn if kind is KVCacheDtype.FP8_E4M3 else torch.int8)
    return (codes.float() * scale).to(dtype)
