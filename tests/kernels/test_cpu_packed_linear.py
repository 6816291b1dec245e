"""PackedLinear (oneDNN-packed bf16 weights) against its reference, F.linear."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from pagedserve.kernels.cpu_packed_linear import PackedLinear, SharedWeightLinear, packed_linear_supported
from pagedserve.kernels.cpu_upcast_linear import load_gemv

pytestmark = pytest.mark.skipif(not packed_linear_supported(), reason="no oneDNN bf16 linear here")


@pytest.mark.parametrize("rows", [1, 5, 64, 300])
@pytest.mark.parametrize("with_bias", [False, True])
def test_matches_f_linear(rows, with_bias):
    gen = torch.Generator().manual_seed(rows)
    x = torch.randn(rows, 96, generator=gen).bfloat16()
    w = torch.randn(200, 96, generator=gen).bfloat16()
    b = torch.randn(200, generator=gen).bfloat16() if with_bias else None
    got, want = PackedLinear(w, b)(x), F.linear(x, w, b)
    assert got.dtype == torch.bfloat16 and got.shape == (rows, 200)
    # Both run oneDNN bf16 kernels with float32 accumulation; allow one bf16 rounding step.
    torch.testing.assert_close(got.float(), want.float(), rtol=1e-2, atol=2e-2)


def test_keeps_leading_dims_and_refuses_what_it_cannot_pack():
    w = torch.randn(8, 16).bfloat16()
    x = torch.randn(2, 3, 16).bfloat16()
    assert PackedLinear(w, None)(x).shape == (2, 3, 8)
    with pytest.raises(ValueError, match="input features"):
        PackedLinear(w, None)(torch.randn(3, 15).bfloat16())
    with pytest.raises(ValueError, match="bfloat16"):
        PackedLinear(w.float(), None)


@pytest.mark.parametrize("rows", [1, 2, 9, 64])
@pytest.mark.parametrize("with_kernel", [False, True])
def test_shared_weight_linear_reads_the_owners_table_and_matches_f_linear(rows, with_kernel):
    """A tied LM head: no copy of the embedding (same storage), F.linear's numbers on both
    paths (the native few-rows kernel for one row, F.linear above)."""
    gemv = load_gemv() if with_kernel else None
    if with_kernel and gemv is None:
        pytest.skip("the native extension is not built here")
    gen = torch.Generator().manual_seed(rows)
    table = torch.nn.Embedding(300, 96, dtype=torch.bfloat16)
    table.weight.data.copy_(torch.randn(300, 96, generator=gen))
    head = SharedWeightLinear(table.weight, gemv=gemv)
    assert head.weight.data_ptr() == table.weight.data_ptr() and not list(head.parameters())
    x = torch.randn(rows, 96, generator=gen).bfloat16()
    torch.testing.assert_close(head(x).float(), F.linear(x, table.weight).float(), rtol=1e-2, atol=2e-2)
    assert head(x.view(1, rows, 96)).shape == (1, rows, 300)
