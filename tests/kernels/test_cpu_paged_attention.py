"""The CPU paged decode-attention kernel against its plain-torch reference, on model-dtype caches
and on quantized ones (int8 / fp8_e4m3 rows of pagedserve.engine.attention.kv_quant)."""

from __future__ import annotations

import pytest
import torch

from pagedserve.kernels.cpu_paged_attention import (
    gather_dequantize,
    load_cpu_kernels,
    paged_decode_attention,
    reference_paged_decode_attention,
)
from tests.kernels import built_or_skip


@pytest.fixture(scope="module")
def ext():
    return built_or_skip(load_cpu_kernels, "paged_decode")


def _inputs(dtype, batch, heads, kv_heads, head_dim, block_size, lens, seed=0):
    g = torch.Generator().manual_seed(seed)
    max_blocks = max(-(-n // block_size) for n in lens)
    num_blocks = batch * max_blocks + 3
    k = torch.randn(num_blocks, block_size, kv_heads, head_dim, generator=g).to(dtype)
    v = torch.randn(num_blocks, block_size, kv_heads, head_dim, generator=g).to(dtype)
    tables = torch.randperm(num_blocks, generator=g)[: batch * max_blocks].view(batch, max_blocks).int()
    q = torch.randn(batch, heads, head_dim, generator=g).to(dtype)
    return q, k, v, tables, torch.tensor(lens, dtype=torch.int32)


@pytest.mark.parametrize(
    "heads, kv_heads, head_dim, block_size, lens",
    [
        (9, 3, 64, 16, [1, 5, 16, 17, 63, 300]),  # SmolLM2 shapes, lengths off every tile size
        (4, 4, 32, 4, [2, 3, 9]),  # no GQA
        (8, 2, 8, 2, [1, 7]),  # head_dim below the vector width: scalar tails only
        (6, 1, 24, 8, [33, 40]),  # head_dim not a multiple of 16
    ],
)
@pytest.mark.parametrize("dtype, tol", [(torch.float32, 1e-5), (torch.bfloat16, 1e-2)])
def test_kernel_matches_reference(ext, heads, kv_heads, head_dim, block_size, lens, dtype, tol):
    q, k, v, tables, seq_lens = _inputs(dtype, len(lens), heads, kv_heads, head_dim, block_size, lens)
    out = paged_decode_attention(ext, q, k, v, tables, seq_lens, 0.3)
    ref = reference_paged_decode_attention(q, k, v, tables, seq_lens, 0.3)
    assert out.shape == q.shape and out.dtype == dtype
    torch.testing.assert_close(out.float(), ref.float(), atol=tol, rtol=tol)


def test_padding_in_block_tables_is_never_read(ext):
    q, k, v, tables, seq_lens = _inputs(torch.float32, 2, 4, 2, 16, 4, [5, 8])
    ref = reference_paged_decode_attention(q, k, v, tables, seq_lens, 0.5)
    k[tables[0, 2:].long()] = float("nan")  # blocks past sequence 0's length
    v[tables[0, 2:].long()] = float("nan")
    out = paged_decode_attention(ext, q, k, v, tables, seq_lens, 0.5)
    torch.testing.assert_close(out[0], ref[0])


def test_launcher_refuses_bad_input(ext):
    q, k, v, tables, seq_lens = _inputs(torch.float32, 1, 4, 2, 16, 4, [3])
    with pytest.raises(ValueError, match="dtypes"):
        paged_decode_attention(ext, q.half(), k.half(), v.half(), tables, seq_lens, 1.0)
    with pytest.raises(ValueError, match="multiple"):
        paged_decode_attention(ext, q[:, :3], k, v, tables, seq_lens, 1.0)


# ---- Quantized KV cache (pagedserve.engine.attention.kv_quant rows: D codes + a bf16 scale) -------------

QUANT_KINDS = ["fp8_e4m3", "int8"]


def _quantized_inputs(kind, dtype, batch, heads, kv_heads, head_dim, block_size, lens, seed=0):
    from pagedserve.engine.attention.kv_dtype import KVCacheDtype
    from pagedserve.engine.attention.kv_quant import quantize_kv

    q, k, v, tables, seq_lens = _inputs(torch.float32, batch, heads, kv_heads, head_dim, block_size, lens, seed)
    scales = torch.logspace(-2, 1, k.shape[0])[:, None, None, None]  # magnitudes differ from block to block
    kind = KVCacheDtype(kind)
    return q.to(dtype), quantize_kv(k * scales, kind), quantize_kv(v * scales, kind), tables, seq_lens


@pytest.mark.parametrize("kind", QUANT_KINDS)
@pytest.mark.parametrize(
    "heads, kv_heads, head_dim, block_size, lens",
    [
        (9, 3, 64, 16, [1, 5, 16, 17, 63, 300]),  # SmolLM2 shapes: GQA group 3
        (4, 4, 32, 4, [2, 3, 9]),  # no GQA
        (8, 2, 8, 2, [1, 7]),  # head_dim below the vector width: scalar code tails only
        (6, 1, 24, 8, [33, 40]),  # head_dim not a multiple of 16, one KV head (group 6)
    ],
)
# float32: values reach ~30 (block scales up to 10), so 1e-4 absolute (float32 sums over 300
# tokens in another order, the kernel's exp polynomial); bfloat16: the output's own rounding.
@pytest.mark.parametrize("dtype, tol", [(torch.float32, 1e-4), (torch.bfloat16, 1e-2)])
def test_quantized_kernel_matches_gather_dequantize_sdpa(
    ext, kind, heads, kv_heads, head_dim, block_size, lens, dtype, tol
):
    """The kernel on the quantized cache against the engine's existing path: gather the rows,
    de-quantize them (kv_quant.dequantize_kv, float32) and attend (the float32 reference)."""
    from pagedserve.engine.attention.kv_dtype import KVCacheDtype
    from pagedserve.engine.attention.kv_quant import dequantize_kv

    q, k, v, tables, seq_lens = _quantized_inputs(kind, dtype, len(lens), heads, kv_heads, head_dim, block_size, lens)
    out = paged_decode_attention(ext, q, k, v, tables, seq_lens, 0.3, kind)
    kf, vf = (dequantize_kv(c, KVCacheDtype(kind), torch.float32) for c in (k, v))
    ref = reference_paged_decode_attention(q.float(), kf, vf, tables, seq_lens, 0.3)
    assert out.shape == q.shape and out.dtype == dtype
    torch.testing.assert_close(out.float(), ref, atol=tol, rtol=tol)


@pytest.mark.parametrize("kind", QUANT_KINDS)
@pytest.mark.parametrize("head_dim", [64, 24, 8])  # vector path + tails, tails only
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_gather_dequantize_is_bit_exact_for_every_code(ext, kind, head_dim, dtype):
    """Every code (e4m3: all but its two NaN codes, which quantize_kv never writes), with scales of
    several magnitudes, through scrambled blocks: the same bits as kv_quant.dequantize_kv."""
    from pagedserve.engine.attention.kv_dtype import KVCacheDtype
    from pagedserve.engine.attention.kv_quant import dequantize_kv

    codes = torch.arange(256, dtype=torch.uint8)
    if kind == "fp8_e4m3":
        codes = codes[(codes & 0x7F) != 0x7F]
    rows = -(-codes.numel() // head_dim)
    codes = codes.repeat(2)[: rows * head_dim].view(rows, head_dim)
    scales = torch.tensor([0.37, 1.0, 3e-3, 17.5, 2e-6])[torch.arange(rows) % 5].to(torch.bfloat16)
    block_size, kv_heads = 2, 1
    num_blocks = -(-rows // block_size)
    cache = torch.cat([codes, scales[:, None].view(torch.uint8)], 1)
    cache = torch.cat([cache, cache[: num_blocks * block_size - rows]]).view(num_blocks, block_size, kv_heads, -1)
    perm = torch.randperm(num_blocks, generator=torch.Generator().manual_seed(0))
    scrambled = torch.empty_like(cache)
    scrambled[perm] = cache  # logical block i lives in physical block perm[i]
    out = gather_dequantize(ext, scrambled, perm.int(), rows, kind, dtype)
    ref = dequantize_kv(cache.view(-1, kv_heads, head_dim + 2)[:rows], KVCacheDtype(kind), dtype)
    assert out.shape == (rows, kv_heads, head_dim) and out.dtype == dtype
    assert torch.equal(
        out.view(torch.int16 if dtype == torch.bfloat16 else torch.int32),
        ref.view(torch.int16 if dtype == torch.bfloat16 else torch.int32),
    )


def test_quantized_padding_in_block_tables_is_never_read(ext):
    q, k, v, tables, seq_lens = _quantized_inputs("int8", torch.float32, 2, 4, 2, 16, 4, [5, 8])
    ref = paged_decode_attention(ext, q, k, v, tables, seq_lens, 0.5, "int8")
    k[tables[0, 2:].long()] = 0xFF  # blocks past sequence 0's length: codes -1, scales NaN
    v[tables[0, 2:].long()] = 0xFF
    out = paged_decode_attention(ext, q, k, v, tables, seq_lens, 0.5, "int8")
    torch.testing.assert_close(out[0], ref[0], atol=0, rtol=0)


def test_launcher_refuses_a_cache_of_the_wrong_kind(ext):
    q, k, v, tables, seq_lens = _quantized_inputs("int8", torch.float32, 1, 4, 2, 16, 4, [3])
    with pytest.raises(ValueError, match="kv_quant must be one of fp8_e4m3, int8"):
        paged_decode_attention(ext, q, k, v, tables, seq_lens, 1.0, "int4")
    with pytest.raises(ValueError, match="dtypes"):
        paged_decode_attention(ext, q, k, v, tables, seq_lens, 1.0)  # uint8 rows read as a plain cache
    with pytest.raises(ValueError, match="do not fit head_dim"):
        paged_decode_attention(ext, q, k[..., :16], v[..., :16], tables, seq_lens, 1.0, "int8")
