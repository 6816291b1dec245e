"""Quantized linear layers equal a plain-torch de-quantize-then-matmul reference.

Shapes are the default model's (SmolLM2-135M: hidden 576, qkv 960, MLP 1536, vocab 49152).
Tolerances: the weight-only paths multiply bf16 activations by `reference_weight()` (exactly,
or rounded to bf16 when de-quantized for a large call), so they differ from the float32 reference
by bf16 rounding and summation order: max |diff| <= 2 % of the output's max |value|. The W8A8 path
(mode w8a8 from 2 rows, mode int8 from 17 to 255 rows) also quantizes activations per row (int8,
symmetric, the largest channels kept in float32): <= 3 % of max |value|.
"""

from __future__ import annotations

import pytest
import torch

from pagedserve.engine.model.quant_linear import (
    INT4_KERNEL_MAX_ROWS,
    INT8_WEIGHT_ONLY_MAX_ROWS,
    W8A8_OUTLIER_CHANNELS,
    Int4Linear,
    Int8Embedding,
    Int8Linear,
    QuantMethod,
    _w8a8_mm,
    make_quant_linear,
    pack_nibbles,
    quantize_int4,
    quantize_int8,
    unpack_nibbles,
)
from pagedserve.kernels.cpu_native import load_native

SHAPES = [(576, 960), (576, 576), (576, 3072), (1536, 576)]  # (in, out): qkv, o, gate_up, down


def _weight(in_f: int, out_f: int) -> torch.Tensor:
    return torch.randn(out_f, in_f, generator=torch.Generator().manual_seed(in_f + out_f)) * 0.05


def _loaded(method: QuantMethod, in_f: int, out_f: int, group: int = 32) -> torch.nn.Module:
    layer = make_quant_linear(method, in_f, out_f, False, torch.bfloat16, group)
    w = _weight(in_f, out_f)
    layer.quantize_rows(0, w[: out_f // 3])  # loaded in two shards, like fused q|k|v
    layer.quantize_rows(out_f // 3, w[out_f // 3 :])
    return layer


def _check(layer, rows: int, tol: float) -> None:
    x = torch.randn(rows, layer.in_features, generator=torch.Generator().manual_seed(rows)).bfloat16()
    want = x.float() @ layer.reference_weight().T
    got = layer(x)
    assert got.dtype == torch.bfloat16 and got.shape == want.shape
    assert (got.float() - want).abs().max() <= tol * want.abs().max()


@pytest.mark.parametrize("in_f,out_f", SHAPES)
@pytest.mark.parametrize("rows", [1, INT8_WEIGHT_ONLY_MAX_ROWS, 64, 300])
def test_int8_matches_reference(in_f, out_f, rows):
    _check(_loaded(QuantMethod.INT8, in_f, out_f), rows, 0.02)


@pytest.mark.parametrize("in_f,out_f", SHAPES)
@pytest.mark.parametrize("rows", [1, 2, 64])
def test_w8a8_matches_reference(in_f, out_f, rows):
    _check(_loaded(QuantMethod.W8A8, in_f, out_f), rows, 0.02 if rows == 1 else 0.03)


@pytest.mark.parametrize("in_f,out_f", SHAPES)
@pytest.mark.parametrize("group", [32, 64])
@pytest.mark.parametrize("rows", [1, INT4_KERNEL_MAX_ROWS, 64])
def test_int4_matches_reference(in_f, out_f, group, rows):
    _check(_loaded(QuantMethod.INT4, in_f, out_f, group), rows, 0.02)


@pytest.mark.parametrize("in_f,out_f", SHAPES)
@pytest.mark.parametrize("rows", [INT4_KERNEL_MAX_ROWS + 1, 300])
def test_int4_with_the_dequant_kernel_matches_reference(in_f, out_f, rows):
    """Above INT4_KERNEL_MAX_ROWS rows an int4 layer given the int4_dequant extension
    de-quantizes with it and runs one GEMM."""
    from pagedserve.kernels.cpu_int4_dequant import load_int4_dequant

    ext = load_int4_dequant()
    if ext is None:
        pytest.skip("the int4_dequant extension cannot be built here")
    layer = make_quant_linear(QuantMethod.INT4, in_f, out_f, False, torch.bfloat16, 32, int4_dequant=ext)
    layer.quantize_rows(0, _weight(in_f, out_f))
    assert layer.kernel_max_rows == INT4_KERNEL_MAX_ROWS
    _check(layer, rows, 0.02)


def test_w8a8_keeps_outlier_channels_out_of_the_int8_product():
    """Activations with a few channels 60x the rest (as the default model's are): leaving the 8
    largest channels out of the per-token int8 quantization cuts the error more than 5x."""
    g = torch.Generator().manual_seed(3)
    layer = _loaded(QuantMethod.W8A8, 576, 960)
    x = torch.randn(64, 576, generator=g)
    x[:, [3, 100, 200]] *= 60
    want = x @ layer.reference_weight().T
    errors = {
        n: ((_w8a8_mm(x.bfloat16(), layer.qweight, layer.scale, n).float() - want).norm() / want.norm()).item()
        for n in (0, W8A8_OUTLIER_CHANNELS)
    }
    assert errors[W8A8_OUTLIER_CHANNELS] < 0.01 and errors[W8A8_OUTLIER_CHANNELS] * 5 < errors[0]


@pytest.mark.parametrize("group", [32, 64])
def test_int4_dequantized_path_matches_reference(group):
    """The many-rows path (weight de-quantized for the call), forced where this CPU would keep
    the kernel (no bf16 dot products: `int4_kernel_max_rows`)."""
    layer = _loaded(QuantMethod.INT4, 576, 3072, group)
    layer.kernel_max_rows = 0
    _check(layer, 40, 0.02)


def test_int4_group_128_on_a_layer_it_divides():
    _check(_loaded(QuantMethod.INT4, 1536, 576, 128), 5, 0.02)


def test_int4_reference_is_the_quantized_weight():
    """The kernel's weight (scales in bf16) is the float32 quantization up to bf16 scale rounding."""
    w = _weight(576, 960)
    codes, scale, offset = quantize_int4(w, 32)
    exact = (codes.float().view(960, -1, 32) * scale[..., None] + offset[..., None]).view(960, 576)
    layer = _loaded(QuantMethod.INT4, 576, 960)
    assert (layer.reference_weight() - exact).abs().max() <= 0.02 * w.abs().max()
    assert (exact - w).abs().max() <= (scale.max() / 2) * 1.001  # round to nearest code


def test_int8_quantization_error_is_half_a_step():
    w = _weight(576, 960)
    q, scale = quantize_int8(w)
    assert ((q.float() * scale[:, None] - w).abs() <= scale[:, None] / 2 + 1e-7).all()


def test_nibble_packing_round_trips():
    codes = torch.randint(0, 16, (64, 96), dtype=torch.uint8)
    assert torch.equal(unpack_nibbles(pack_nibbles(codes)), codes)


def test_embedding_and_shared_head():
    w = _weight(576, 640)
    emb = Int8Embedding(640, 576, torch.bfloat16)
    emb.set_weight(w)
    ids = torch.tensor([0, 5, 639])
    q, s = quantize_int8(w)
    assert torch.equal(emb(ids), (q[ids].float() * s[ids, None]).bfloat16())
    head = Int8Linear.sharing(emb.qweight, emb.scale, torch.bfloat16)
    assert head.qweight.data_ptr() == emb.qweight.data_ptr()
    _check(head, 3, 0.02)
    _check(head, 64, 0.02)  # weight-only at every row count: float32 GEMMs on widened chunks here
    native = Int8Linear.sharing(emb.qweight, emb.scale, torch.bfloat16, io=load_native())
    _check(native, 3, 0.02)  # the native few-row GEMV where the extension is built


def test_bad_group_sizes_and_shapes_are_refused():
    with pytest.raises(ValueError, match="group size 128 does not divide the layer's 576"):
        Int4Linear(576, 960, False, torch.bfloat16, 128)
    with pytest.raises(ValueError, match="must be one of"):
        Int4Linear(576, 960, False, torch.bfloat16, 48)
    with pytest.raises(ValueError, match="divisible by 64"):
        Int4Linear(576, 100, False, torch.bfloat16, 32)
    layer = Int8Linear(576, 64, False, torch.bfloat16)
    with pytest.raises(ValueError, match="outside 64 output features"):
        layer.quantize_rows(32, _weight(576, 64))
