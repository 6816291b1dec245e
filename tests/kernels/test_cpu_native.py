"""The native extension's instruction-set paths: every kernel on every path this CPU runs
(scalar, AVX2, AVX-512, AVX512-BF16) against a float64 reference on random shapes with ragged
tails, and the AVX2 path forced on an AVX-512 machine against the AVX-512 one.

On an AVX2-only CPU the comparisons run AVX2 against the scalar path; the AVX-512 ones skip."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
import torch

from pagedserve.kernels.cpu_native import ISA_NAMES, available_isas, load_native
from tests.kernels import built_or_skip


@pytest.fixture(scope="module")
def ext():
    return built_or_skip(load_native, "native")


@pytest.fixture(scope="module")
def isas(ext):
    return available_isas(ext)


def _gen(seed: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


def _each_isa(isas):
    return [isa for isa in ISA_NAMES if isa in isas]


# ---- dispatch ------------------------------------------------------------------------------
def test_the_default_path_is_the_best_one_and_an_unknown_or_missing_isa_is_refused(ext, isas):
    assert ext.cpu_isa() == ext.detected_isa() == isas[-1] or os.environ.get("PAGEDSERVE_CPU_ISA")
    assert isas[0] == "scalar"
    with pytest.raises(RuntimeError, match="isa must be one of"):
        ext.rms_norm(torch.ones(1, 4), torch.ones(4), 1e-6, 8, isa="sse9")
    if isas[-1] != "avx512_bf16":
        with pytest.raises(RuntimeError, match="not available on this CPU"):
            ext.cpu_isa("avx512_bf16")


def test_the_environment_caps_the_path_in_a_fresh_process(ext):
    code = "from pagedserve.kernels.cpu_native import load_native; print(load_native().cpu_isa())"
    env = dict(os.environ, PAGEDSERVE_CPU_ISA="scalar")
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "scalar"


# ---- float64 references, every path ---------------------------------------------------------
@pytest.mark.parametrize("rows,k,n", [(1, 576, 33), (1, 37, 5), (3, 200, 17), (8, 577, 40), (5, 15, 3)])
def test_bf16_gemv_against_float64(ext, isas, rows, k, n):
    g = _gen(rows * k + n)
    x = torch.randn(rows, k, generator=g).bfloat16()
    w = torch.randn(n, k, generator=g).bfloat16()
    b = torch.randn(n, generator=g).bfloat16()
    want = x.double() @ w.double().t() + b.double()
    bound = (x.double().abs() @ w.double().abs().t()) * k * 2**-23 + want.abs() * 2**-8 + 1e-6  # accum + bf16 rounding
    for isa in _each_isa(isas):
        got = ext.bf16_linear_few_rows(x, w, b, isa=isa)
        assert ((got.double() - want).abs() <= bound).all(), isa


def _pack_int4(codes: torch.Tensor, block_n: int) -> torch.Tensor:
    """The inverse of pagedserve.kernels.cpu_int4_dequant.unpack_codes: uint8 [N, K / 2]."""
    n, k = codes.shape
    blocks = codes.view(n // block_n, block_n, k).permute(0, 2, 1)  # [N / B, K, B]
    half = block_n // 2
    return (blocks[..., :half] | (blocks[..., half:] << 4)).contiguous().view(n, k // 2)


@pytest.mark.parametrize("block_n", [32, 64])
@pytest.mark.parametrize("n,k,group", [(64, 96, 32), (192, 64, 64), (128, 160, 32)])
def test_int4_dequant_against_float64(ext, isas, block_n, n, k, group):
    g = _gen(n + k + group + block_n)
    codes = torch.randint(0, 16, (n, k), generator=g, dtype=torch.uint8)
    scale = torch.rand(k // group, n, generator=g) * 0.1
    shift = torch.randn(k // group, n, generator=g)
    groups = torch.arange(k) // group
    want = (codes.t().double() * scale[groups].double() + shift[groups].double()).float()  # one rounding, as an FMA
    for isa in _each_isa(isas):
        got = ext.int4pack_dequant_t(_pack_int4(codes, block_n), scale, shift, group, block_n, isa=isa)
        assert torch.equal(got, want), isa


@pytest.mark.parametrize("block_n", [32, 64])
@pytest.mark.parametrize("rows,n,k,group", [(1, 64, 96, 32), (3, 192, 64, 64), (5, 128, 160, 32), (16, 64, 64, 32)])
def test_int4_gemv_against_float64(ext, isas, block_n, rows, n, k, group):
    g = _gen(rows + n + k + block_n)
    codes = torch.randint(0, 16, (n, k), generator=g, dtype=torch.uint8)
    scale = torch.rand(k // group, n, generator=g) * 0.1
    shift = torch.randn(k // group, n, generator=g) * 0.1
    x = torch.randn(rows, k, generator=g)
    groups = torch.arange(k) // group
    w = codes.t().double() * scale[groups].double() + shift[groups].double()  # [K, N]
    want = x.double() @ w
    bound = (
        x.double().abs() @ (codes.t().double() * scale[groups].double() + shift[groups].double().abs())
    ) * 3e-5 + 1e-6
    for isa in _each_isa(isas):
        got = ext.int4pack_gemv(x, _pack_int4(codes, block_n), scale, shift, group, block_n, isa=isa)
        assert got.shape == (rows, n) and ((got.double() - want).abs() <= bound).all(), isa
    with pytest.raises(RuntimeError, match="1 to 16 rows"):
        ext.int4pack_gemv(torch.zeros(17, k), _pack_int4(codes, block_n), scale, shift, group, block_n)


@pytest.mark.parametrize("rows,k,outliers", [(1, 64, 0), (7, 100, 3), (33, 19, 2)])
def test_int8_quantize_and_epilogue_against_float64(ext, isas, rows, k, outliers):
    g = _gen(rows + k)
    x = torch.randn(rows, k, generator=g) * torch.rand(k, generator=g) * 10
    acc = torch.randint(-5000, 5000, (rows, 29), generator=g, dtype=torch.int32)
    x_scale, w_scale = torch.rand(rows, generator=g), torch.rand(29, generator=g)
    x_out, w_out = torch.randn(rows, outliers, generator=g), torch.randn(outliers, 29, generator=g)
    want = (acc.double() * x_scale.double()[:, None] + x_out.double() @ w_out.double()) * w_scale.double()
    for isa in _each_isa(isas):
        xq, xs, _, cols = ext.int8_quantize_rows(x, outliers, isa=isa)
        rest = x.double().index_fill(1, cols, 0.0)
        assert torch.allclose(xs.double(), rest.abs().amax(1) / 127, rtol=1e-6)
        assert ((xq.double() - rest / xs.double()[:, None]).abs() <= 0.5 + 1e-4).all(), isa
        got = ext.int8_mm_epilogue(acc, x_scale, w_scale, x_out, w_out, False, isa=isa)
        torch.testing.assert_close(got.double(), want, rtol=1e-5, atol=1e-4)


@pytest.mark.parametrize("rows,n", [(1, 576), (3, 37), (5, 8), (2, 1000)])
def test_fused_ops_against_float64(ext, isas, rows, n):
    g = _gen(rows * n)
    x, r, w = torch.randn(rows, n, generator=g), torch.randn(rows, n, generator=g), torch.rand(n, generator=g) + 0.5
    xd = x.double()
    want_norm = w.double() * xd * torch.rsqrt(xd.pow(2).mean(-1, keepdim=True) + 1e-5)
    rd = r.double() + xd
    want_fused = w.double() * rd * torch.rsqrt(rd.pow(2).mean(-1, keepdim=True) + 1e-5)
    gu = torch.randn(rows, 2 * n, generator=g) * 4
    want_silu = torch.nn.functional.silu(gu[:, :n].double()) * gu[:, n:].double()
    half = n // 2 * 2  # RoPE: even head_dim, 1 token row per `rows`, one head
    xr = torch.randn(rows, 1, half, generator=g)
    ang = torch.rand(rows, half // 2, generator=g) * 6
    cos, sin = ang.cos(), ang.sin()
    a, b = xr.double()[..., : half // 2], xr.double()[..., half // 2 :]
    want_rope = torch.cat(
        (a * cos.double()[:, None] - b * sin.double()[:, None], b * cos.double()[:, None] + a * sin.double()[:, None]),
        dim=-1,
    )
    for isa in _each_isa(isas):
        for width in (8, 16):
            torch.testing.assert_close(
                ext.rms_norm(x, w, 1e-5, width, isa=isa).double(), want_norm, rtol=1e-5, atol=1e-6
            )
            res = r.clone()
            torch.testing.assert_close(
                ext.fused_add_rms_norm(x, res, w, 1e-5, width, isa=isa).double(), want_fused, rtol=1e-5, atol=1e-6
            )
            torch.testing.assert_close(res.double(), rd, rtol=1e-6, atol=1e-6)
        for vec_bytes in (0, 32, 64):
            torch.testing.assert_close(
                ext.silu_and_mul(gu, vec_bytes, isa=isa).double(), want_silu, rtol=1e-5, atol=1e-5
            )
        got = xr.clone()
        ext.rotary_embedding_(got, cos, sin, isa=isa)
        torch.testing.assert_close(got.double(), want_rope, rtol=1e-5, atol=1e-6)


def _decode_inputs(dtype, heads, kv_heads, head_dim, block_size, lens, seed):
    g = _gen(seed)
    max_blocks = max(-(-n // block_size) for n in lens)
    num_blocks = len(lens) * max_blocks + 2
    k = torch.randn(num_blocks, block_size, kv_heads, head_dim, generator=g).to(dtype)
    v = torch.randn(num_blocks, block_size, kv_heads, head_dim, generator=g).to(dtype)
    tables = torch.randperm(num_blocks, generator=g)[: len(lens) * max_blocks].view(len(lens), max_blocks).int()
    q = torch.randn(len(lens), heads, head_dim, generator=g).to(dtype)
    return q, k, v, tables, torch.tensor(lens, dtype=torch.int32)


def _decode_float64(q, k, v, tables, lens, scale):
    heads, head_dim = q.shape[1:]
    block_size, kv_heads = k.shape[1:3]
    out = torch.empty(q.shape, dtype=torch.float64)
    for b, length in enumerate(lens.tolist()):
        blocks = tables[b, : -(-length // block_size)].long()
        kk = k[blocks].reshape(-1, kv_heads, head_dim)[:length].double().repeat_interleave(heads // kv_heads, 1)
        vv = v[blocks].reshape(-1, kv_heads, head_dim)[:length].double().repeat_interleave(heads // kv_heads, 1)
        p = (torch.einsum("hd,lhd->hl", q[b].double(), kk) * scale).softmax(-1)
        out[b] = torch.einsum("hl,lhd->hd", p, vv)
    return out


@pytest.mark.parametrize(
    "heads,kv_heads,head_dim,block_size,lens",
    [
        (9, 3, 64, 16, [1, 17, 63, 130]),  # SmolLM2's shape, lengths off every tile size
        (4, 4, 48, 4, [3, 9]),  # head_dim a multiple of 16 but not of 32 (no bf16 dot products)
        (6, 2, 24, 8, [33, 5]),  # a multiple of 8, not of 16: AVX2 vectors, AVX-512's scalar path
        (2, 1, 20, 2, [7]),  # ragged: vector body plus a scalar tail everywhere
    ],
)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_paged_decode_against_float64(ext, isas, heads, kv_heads, head_dim, block_size, lens, dtype):
    q, k, v, tables, seq_lens = _decode_inputs(dtype, heads, kv_heads, head_dim, block_size, lens, head_dim)
    want = _decode_float64(q, k, v, tables, seq_lens, 0.3)
    tol = 1e-5 if dtype == torch.float32 else 8e-3  # bf16: one output rounding
    for isa in _each_isa(isas):
        got = ext.paged_decode_attention(q, k, v, tables, seq_lens, 0.3, "", isa=isa)
        torch.testing.assert_close(got.double(), want, rtol=tol, atol=tol, msg=lambda m, isa=isa: f"{isa}: {m}")


@pytest.mark.parametrize("kv_quant", ["int8", "fp8_e4m3"])
@pytest.mark.parametrize("head_dim", [64, 24, 20])
def test_quantized_decode_and_gather_against_float64(ext, isas, kv_quant, head_dim):
    from pagedserve.engine.attention.kv_dtype import KVCacheDtype
    from pagedserve.engine.attention.kv_quant import dequantize_kv, quantize_kv

    kind = KVCacheDtype(kv_quant)
    q, k, v, tables, seq_lens = _decode_inputs(torch.float32, 6, 2, head_dim, 8, [1, 19, 40], head_dim + 7)
    kq, vq = quantize_kv(k, kind), quantize_kv(v, kind)
    kd, vd = dequantize_kv(kq, kind, torch.float32), dequantize_kv(vq, kind, torch.float32)
    # Decoding the quantized cache is decoding its de-quantized values (code * scale, exact in float32).
    want = _decode_float64(q, kd, vd, tables, seq_lens, 0.3)
    blocks = tables[2]
    for isa in _each_isa(isas):
        got = ext.paged_decode_attention(q, kq, vq, tables, seq_lens, 0.3, kv_quant, isa=isa)
        torch.testing.assert_close(got.double(), want, rtol=1e-5, atol=1e-5, msg=lambda m, isa=isa: f"{isa}: {m}")
        gathered = torch.empty(40, 2, head_dim)
        ext.gather_dequantize(kq, blocks, gathered, kv_quant, isa=isa)
        assert torch.equal(gathered, kd[blocks.long()].reshape(-1, 2, head_dim)[:40]), isa


# ---- the AVX2 path forced on an AVX-512 machine, against the AVX-512 path --------------------
def _wide_pairs(isas):
    """(narrow, wide) paths to compare: avx2 against each AVX-512 level, else scalar vs avx2."""
    if "avx512" in isas:
        return [("avx2", wide) for wide in isas if wide.startswith("avx512")]
    if "avx2" in isas:
        return [("scalar", "avx2")]
    pytest.skip("only the scalar path runs on this CPU")


def test_avx2_forced_equals_avx512_for_every_kernel(ext, isas):
    g = _gen(11)
    x = torch.randn(3, 577, generator=g).bfloat16()
    w = torch.randn(45, 577, generator=g).bfloat16()
    codes = torch.randint(0, 16, (128, 96), generator=g, dtype=torch.uint8)
    scale, shift = torch.rand(3, 128, generator=g), torch.randn(3, 128, generator=g)
    xf = torch.randn(9, 211, generator=g) * 5
    acc = torch.randint(-999, 999, (9, 40), generator=g, dtype=torch.int32)
    xs, ws = torch.rand(9, generator=g), torch.rand(40, generator=g)
    xo, wo = torch.randn(9, 2, generator=g), torch.randn(2, 40, generator=g)
    nw = torch.rand(211, generator=g).bfloat16()
    xb = xf.bfloat16()
    gu = torch.randn(4, 422, generator=g).bfloat16()
    rope_x = torch.randn(5, 3, 64, generator=g).bfloat16()
    ang = torch.rand(5, 32, generator=g)
    q, k, v, tables, lens = _decode_inputs(torch.bfloat16, 9, 3, 64, 16, [1, 17, 63, 130], 5)
    from pagedserve.engine.attention.kv_dtype import KVCacheDtype
    from pagedserve.engine.attention.kv_quant import quantize_kv

    kq, vq = quantize_kv(k.float(), KVCacheDtype.INT8), quantize_kv(v.float(), KVCacheDtype.INT8)

    def run(isa):
        rope = rope_x.clone()
        ext.rotary_embedding_(rope, ang.cos().bfloat16(), ang.sin().bfloat16(), isa=isa)
        res = xb.clone()
        gathered = torch.empty(130, 3, 64)
        ext.gather_dequantize(kq, tables[3], gathered, "int8", isa=isa)
        return {
            "bf16_gemv": ext.bf16_linear_few_rows(x, w, None, isa=isa),
            "int4_dequant": ext.int4pack_dequant_t(_pack_int4(codes, 64), scale, shift, 32, 64, isa=isa),
            "int4_gemv": ext.int4pack_gemv(
                xf[:5, :96].contiguous(), _pack_int4(codes, 64), scale, shift, 32, 64, isa=isa
            ),
            "int8_quantize_rows": ext.int8_quantize_rows(xf, 3, isa=isa),
            "int8_mm_epilogue": ext.int8_mm_epilogue(acc, xs, ws, xo, wo, True, isa=isa),
            "rms_norm": ext.rms_norm(xb, nw, 1e-5, 8, isa=isa),
            "fused_add_rms_norm": (ext.fused_add_rms_norm(xb, res, nw, 1e-5, 8, isa=isa), res),
            "silu_and_mul": ext.silu_and_mul(gu, 32, isa=isa),
            "rotary_embedding_": rope,
            "paged_decode_attention": ext.paged_decode_attention(q, k, v, tables, lens, 0.125, "", isa=isa),
            "paged_decode_attention int8": ext.paged_decode_attention(q, kq, vq, tables, lens, 0.125, "int8", isa=isa),
            "gather_dequantize": gathered,
        }

    # Sums of float32 products in another vector width differ by rounding only; all else is exact.
    summed = {"bf16_gemv", "int4_gemv", "paged_decode_attention", "paged_decode_attention int8"}
    for narrow, wide in _wide_pairs(isas):
        a, b = run(narrow), run(wide)
        for name in a:
            got, want = a[name], b[name]
            if name in summed:
                torch.testing.assert_close(
                    got.float(),
                    want.float(),
                    rtol=8e-3,
                    atol=1e-5,
                    msg=lambda m, where=f"{name} {narrow} vs {wide}": f"{where}: {m}",
                )
            else:
                for t_got, t_want in zip(
                    got if isinstance(got, (tuple, list)) else [got],
                    want if isinstance(want, (tuple, list)) else [want],
                ):
                    assert torch.equal(t_got, t_want), f"{name}: {narrow} != {wide}"
