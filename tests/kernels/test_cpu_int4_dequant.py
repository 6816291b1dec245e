"""The int4_dequant kernel against its plain-torch reference and against Int4Linear's own
de-quantization (bit-exact), on the default model's shapes."""

from __future__ import annotations

import pytest
import torch

from engine.model.quant_linear import Int4Linear
from kernels.cpu_int4_dequant import (
    int4pack_dequant_t,
    int4pack_linear,
    load_int4_dequant,
    reference_int4pack_dequant_t,
    scale_and_shift,
)


@pytest.fixture(scope="module")
def ext():
    loaded = load_int4_dequant()
    if loaded is None:
        pytest.skip("the int4_dequant extension cannot be built here")
    return loaded


@pytest.mark.parametrize("in_f,out_f", [(576, 960), (1536, 576), (64, 128)])
@pytest.mark.parametrize("group", [32, 64])
def test_matches_the_reference_and_the_layer_exactly(ext, in_f, out_f, group):
    layer = Int4Linear(in_f, out_f, False, torch.bfloat16, group)
    layer.quantize_rows(0, torch.randn(out_f, in_f, generator=torch.Generator().manual_seed(in_f + group)))
    scale, shift = scale_and_shift(layer.scales_and_zeros)
    got = int4pack_dequant_t(ext, layer.packed, scale, shift, group)
    assert got.shape == (in_f, out_f) and got.dtype == torch.float32
    assert torch.equal(got, reference_int4pack_dequant_t(layer.packed, scale, shift, group))
    # The layer's (q - 8) * scale + zero and the kernel's q * scale + (zero - 8 * scale) agree
    # to float32 rounding.
    torch.testing.assert_close(got, layer.dequantized(torch.float32).t(), rtol=1e-6, atol=1e-6)


def test_chunked_linear_equals_the_product_with_the_whole_matrix(ext):
    layer = Int4Linear(576, 1536, False, torch.bfloat16, 32)
    layer.quantize_rows(0, torch.randn(1536, 576, generator=torch.Generator().manual_seed(1)))
    scale, shift = scale_and_shift(layer.scales_and_zeros)
    x = torch.randn(40, 576, generator=torch.Generator().manual_seed(2)).bfloat16()
    whole = x.float() @ int4pack_dequant_t(ext, layer.packed, scale, shift, 32)
    for chunk in (512, 448, 64, 4096):  # 1536 columns: 3 chunks, 4 with a short last one, 24, 1
        torch.testing.assert_close(int4pack_linear(ext, x, layer.packed, scale, shift, 32, chunk), whole,
                                   rtol=1e-5, atol=1e-5)


def test_refuses_bad_shapes(ext):
    packed = torch.zeros(64, 16, dtype=torch.uint8)
    scale = torch.zeros(1, 64)
    with pytest.raises(RuntimeError, match="group_size must divide K"):
        ext.int4pack_dequant_t(packed, scale, scale, 5)
    with pytest.raises(RuntimeError, match="multiple of 64"):
        ext.int4pack_dequant_t(torch.zeros(32, 16, dtype=torch.uint8), scale, scale, 32)
    with pytest.raises(RuntimeError, match=r"scale must be \[K / group_size, N\]"):
        ext.int4pack_dequant_t(packed, torch.zeros(2, 64), torch.zeros(2, 64), 32)
    with pytest.raises(RuntimeError, match="multiples of 64"):
        ext.int4pack_dequant_t_into(packed, scale, scale, 32, 0, 32, torch.zeros(32, 32))
