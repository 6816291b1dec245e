"""The CPU paged decode-attention kernel against its plain-torch reference."""

from __future__ import annotations

import pytest
import torch

from kernels.cpu_paged_attention import (
    load_cpu_kernels,
    paged_decode_attention,
    reference_paged_decode_attention,
)


@pytest.fixture(scope="module")
def ext():
    kernels = load_cpu_kernels()
    if kernels is None:
        pytest.skip("the CPU attention kernel could not be built here (no g++/ninja?)")
    return kernels


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
