"""The int8_mm_io kernels against `_w8a8_mm`'s torch form (their reference), on the default
model's shapes, with and without outlier channels, float32 and bf16 activations."""

from __future__ import annotations

import pytest
import torch

from pagedserve.engine.model.quant_linear import _w8a8_mm, quantize_int8
from pagedserve.kernels.cpu_int8_mm_io import load_int8_mm_io
from pagedserve.kernels.cpu_native import available_isas
from tests.kernels import built_or_skip


@pytest.fixture(scope="module")
def ext():
    return built_or_skip(load_int8_mm_io, "int8_mm_io")


@pytest.mark.parametrize("rows,in_f,out_f", [(17, 576, 960), (64, 1536, 576), (300, 576, 3072), (20, 64, 300)])
@pytest.mark.parametrize("outliers", [0, 8])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_matches_the_torch_epilogue(ext, rows, in_f, out_f, outliers, dtype):
    gen = torch.Generator().manual_seed(rows + out_f)
    weight = torch.randn(out_f, in_f, generator=gen)
    qweight, scale = quantize_int8(weight)
    x = torch.randn(rows, in_f, generator=gen)
    # Eight channels far above the rest, as the default model has (and no tie for the eighth).
    x[:, :8] *= 50 + 10 * torch.arange(8)
    x = x.to(dtype)
    got = _w8a8_mm(x, qweight, scale, outliers, io=ext)
    want = _w8a8_mm(x, qweight, scale, outliers)
    assert torch.equal(_w8a8_mm(x, qweight, scale, outliers, io=ext), got)  # x left as it was
    assert got.dtype == dtype and got.shape == (rows, out_f)
    # The same float32 products summed in another order, then (bf16) one rounding each.
    if dtype == torch.float32:
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-4)
    else:
        torch.testing.assert_close(got.float(), want.float(), rtol=8e-3, atol=1e-2)
    if outliers:  # both are the layer's product up to the activations' int8 rounding
        ref = x.float() @ (qweight.float() * scale[:, None]).t()
        assert ((got.float() - ref).norm() / ref.norm()).item() < 0.02


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_quantize_rows_is_bit_exact_with_torch(ext, dtype):
    gen = torch.Generator().manual_seed(3)
    x = (torch.randn(70, 576, generator=gen) * torch.rand(576, generator=gen) * 20).to(dtype)
    x[5, 100] = 0.5 * 127 / 127  # values on rounding boundaries exercise half-to-even
    xq, x_scale, x_out, cols = ext.int8_quantize_rows(x, 8)
    xf = x.float()
    want_cols = xf.abs().amax(dim=0).topk(8).indices
    assert set(cols.tolist()) == set(want_cols.tolist())
    torch.testing.assert_close(x_out, xf[:, cols], rtol=0, atol=0)
    rest = xf.index_fill(1, cols, 0.0)
    want_scale = rest.abs().amax(dim=1).clamp_min(1e-12) / 127
    assert torch.equal(x_scale, want_scale)
    assert torch.equal(xq, torch.round(rest / want_scale[:, None]).to(torch.int8))
    zero_rows = ext.int8_quantize_rows(torch.zeros(2, 16, dtype=dtype), 0)
    assert torch.equal(zero_rows[0], torch.zeros(2, 16, dtype=torch.int8)) and zero_rows[2].shape == (2, 0)


def test_refuses_mismatched_shapes(ext):
    acc = torch.zeros(4, 8, dtype=torch.int32)
    with pytest.raises(RuntimeError, match="x_scale"):
        ext.int8_mm_epilogue(acc, torch.ones(3), torch.ones(8), torch.zeros(4, 0), torch.zeros(0, 8), False)
    with pytest.raises(RuntimeError, match="w_out"):
        ext.int8_mm_epilogue(acc, torch.ones(4), torch.ones(8), torch.zeros(4, 2), torch.zeros(2, 7), False)
    with pytest.raises(RuntimeError, match="outliers"):
        ext.int8_quantize_rows(torch.zeros(2, 4), 5)


@pytest.mark.parametrize("rows,in_f,out_f", [(1, 576, 960), (3, 1536, 576), (16, 37, 50)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_few_row_linear_matches_torchs_weight_only_kernel(ext, rows, in_f, out_f, dtype):
    """The native weight-only int8 GEMV (decode rows, the LM head) against the float64 product
    rounded once to the dtype (what `aten._weight_int8pack_mm` computes; that kernel crashes on
    a ragged K such as 37), on every instruction-set path."""
    gen = torch.Generator().manual_seed(rows * in_f)
    qweight, scale = quantize_int8(torch.randn(out_f, in_f, generator=gen))
    x = torch.randn(rows, in_f, generator=gen).to(dtype)
    want = (x.double() @ (qweight.double() * scale.to(dtype).double()[:, None]).t()).to(dtype)
    tol = 1e-4 if dtype == torch.float32 else 1e-2  # summation order; bf16: one rounding of the sum
    for isa in available_isas(ext):
        got = ext.int8_linear_few_rows(x, qweight, scale.to(dtype), isa=isa)
        assert got.dtype == dtype and got.shape == (rows, out_f)
        torch.testing.assert_close(got.float(), want.float(), rtol=tol, atol=tol, msg=lambda m: f"{isa}: {m}")
    with pytest.raises(RuntimeError, match="scale must be"):
        ext.int8_linear_few_rows(x, qweight, scale.to(torch.float64))
