"""UpcastLinear (bf16 weights, float32 GEMMs by weight chunks) against F.linear, and the CPU
flag reading that picks it."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from pagedserve.kernels.cpu_isa import cpu_flags, cpu_has_bf16_dot, cpu_has_vnni
from pagedserve.kernels.cpu_upcast_linear import GEMV_MAX_ROWS, UpcastLinear, load_gemv, upcast_linear
from tests.kernels import built_or_skip


@pytest.fixture(scope="module")
def gemv():
    return built_or_skip(load_gemv, "bf16_gemv")


@pytest.mark.parametrize("rows", [1, 3, 4, 64, 300])
@pytest.mark.parametrize("with_bias", [False, True])
def test_matches_f_linear(rows, with_bias):
    gen = torch.Generator().manual_seed(rows)
    x = torch.randn(rows, 96, generator=gen).bfloat16()
    w = torch.randn(1100, 96, generator=gen).bfloat16()  # 3 chunks of 512 rows, the last short
    b = torch.randn(1100, generator=gen).bfloat16() if with_bias else None
    got = UpcastLinear(w, b)(x)
    assert got.dtype == torch.bfloat16 and got.shape == (rows, 1100)
    # The float32 reference rounded once to bf16 is what the chunked GEMM computes, up to
    # summation order: at most one bf16 rounding step apart.
    want = F.linear(x.float(), w.float(), None if b is None else b.float()).bfloat16()
    torch.testing.assert_close(got.float(), want.float(), rtol=8e-3, atol=1e-2)


def test_chunks_cover_every_output_column():
    # Identity-like weight: each output column equals one input column, so a missed or shifted
    # chunk shows as a wrong column.
    w = torch.zeros(7, 5).bfloat16()
    for i in range(7):
        w[i, i % 5] = 1
    x = torch.arange(20, dtype=torch.float32).view(4, 5).bfloat16()
    out = upcast_linear(x, w, None, chunk_rows=3)
    assert torch.equal(out, x[:, [i % 5 for i in range(7)]])


def test_few_rows_take_the_bf16_path_and_leading_dims_stay():
    w = torch.randn(8, 16).bfloat16()
    layer = UpcastLinear(w, None, min_rows=4)
    x = torch.randn(3, 16).bfloat16()
    assert torch.equal(layer(x), F.linear(x, w))  # 3 rows < 4: exactly F.linear
    assert layer(torch.randn(2, 3, 16).bfloat16()).shape == (2, 3, 8)
    with pytest.raises(ValueError, match="input features"):
        layer(torch.randn(3, 15).bfloat16())
    with pytest.raises(ValueError, match="bfloat16"):
        UpcastLinear(w.float(), None)


@pytest.mark.parametrize("rows", range(1, GEMV_MAX_ROWS + 1))
@pytest.mark.parametrize("in_features", [576, 100, 7])  # a multiple of 64, of neither 64 nor 16
def test_few_rows_kernel_matches_the_float32_product(gemv, rows, in_features):
    gen = torch.Generator().manual_seed(rows * 1000 + in_features)
    x = torch.randn(rows, in_features, generator=gen).bfloat16()
    w = torch.randn(70, in_features, generator=gen).bfloat16()
    b = torch.randn(70, generator=gen).bfloat16()
    got = UpcastLinear(w, b, min_rows=GEMV_MAX_ROWS + 1, gemv=gemv)(x)
    want = F.linear(x.float(), w.float(), b.float()).bfloat16()
    assert got.dtype == torch.bfloat16 and got.shape == (rows, 70)
    torch.testing.assert_close(got.float(), want.float(), rtol=8e-3, atol=1e-2)


def test_few_rows_kernel_refuses_what_it_cannot_take(gemv):
    w = torch.randn(8, 16).bfloat16()
    with pytest.raises(RuntimeError, match="at most 8 rows"):
        gemv.bf16_linear_few_rows(torch.randn(9, 16).bfloat16(), w, None)
    with pytest.raises(RuntimeError, match="bfloat16"):
        gemv.bf16_linear_few_rows(torch.randn(1, 16), w, None)
    with pytest.raises(ValueError, match="at most"):
        UpcastLinear(w, None, min_rows=GEMV_MAX_ROWS + 2, gemv=gemv)


def test_weight_shares_storage_with_the_tied_embedding():
    emb = torch.randn(10, 4).bfloat16()
    assert UpcastLinear(emb, None).weight.data_ptr() == emb.data_ptr()


def test_flags(tmp_path):
    info = tmp_path / "cpuinfo"
    info.write_text("processor\t: 0\nflags\t\t: fpu avx512f avx512_vnni\n")
    flags = cpu_flags(str(info))
    assert flags == ["fpu", "avx512f", "avx512_vnni"]
    assert cpu_has_vnni(flags) and not cpu_has_bf16_dot(flags)
    assert cpu_has_bf16_dot(["avx512_bf16"]) and cpu_has_bf16_dot(["amx_bf16"])
    assert not cpu_has_vnni(["avx2"])
    # Unknown flags (another OS): keep torch's bf16 GEMMs, refuse w8a8.
    assert cpu_flags(str(tmp_path / "missing")) is None
    info.write_text("processor\t: 0\n")
    assert cpu_flags(str(info)) is None


def test_the_isa_cap_hides_the_flags_above_it(tmp_path, monkeypatch):
    """PAGEDSERVE_CPU_ISA=avx2 makes an AVX-512/AMX machine choose as an AVX2-only one does."""
    info = tmp_path / "cpuinfo"
    info.write_text("processor\t: 0\nflags\t\t: fma avx2 avx512f avx512_bf16 avx512_vnni amx_bf16 avx_vnni\n")
    monkeypatch.setenv("PAGEDSERVE_CPU_ISA", "avx2")
    flags = cpu_flags(str(info))
    assert flags == ["fma", "avx2"]
    assert not cpu_has_bf16_dot(flags) and not cpu_has_vnni(flags)
    monkeypatch.setenv("PAGEDSERVE_CPU_ISA", "avx512")
    assert cpu_flags(str(info)) == ["fma", "avx2", "avx512f", "avx512_vnni", "avx_vnni"]
