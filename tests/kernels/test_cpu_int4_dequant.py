"""The int4_dequant kernel against its plain-torch reference and against Int4Linear's own
de-quantization (bit-exact), on the default model's shapes."""

from __future__ import annotations

import pytest
import torch

from pagedserve.engine.model.quant_linear import Int4Linear
from pagedserve.kernels.cpu_int4_dequant import (
    int4pack_dequant_t,
    int4pack_linear,
    load_int4_dequant,
    packed_block_n,
    reference_int4pack_dequant_t,
    scale_and_shift,
    unpack_codes,
)
from tests.kernels import built_or_skip


@pytest.fixture(scope="module")
def ext():
    return built_or_skip(load_int4_dequant, "int4_dequant")


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


def test_the_packed_layout_reads_back_torchs_codes():
    """torch packs in 64-row blocks under AVX-512 and 32-row blocks under AVX2 (AMD Zen 3, say):
    the block size read off torch must give back the codes it was handed."""
    codes = torch.randint(0, 16, (192, 96), generator=torch.Generator().manual_seed(3), dtype=torch.int32)
    packed = torch.ops.aten._convert_weight_to_int4pack_for_cpu(codes, 2)
    assert packed_block_n() == (64 if torch.backends.cpu.get_cpu_capability().startswith("AVX512") else 32)
    assert torch.equal(unpack_codes(packed, packed_block_n()), codes.to(torch.uint8))


@pytest.mark.parametrize("block_n", [32, 64])
def test_kernel_reads_either_block_size(ext, block_n):
    packed = torch.randint(0, 256, (192, 48), generator=torch.Generator().manual_seed(block_n), dtype=torch.uint8)
    scale = torch.rand(3, 192, generator=torch.Generator().manual_seed(5))
    shift = torch.randn(3, 192, generator=torch.Generator().manual_seed(6))
    want = unpack_codes(packed, block_n).t().float() * scale.repeat_interleave(32, 0) + shift.repeat_interleave(32, 0)
    torch.testing.assert_close(ext.int4pack_dequant_t(packed, scale, shift, 32, block_n), want, rtol=1e-6, atol=1e-6)


def test_chunked_linear_equals_the_product_with_the_whole_matrix(ext):
    layer = Int4Linear(576, 1536, False, torch.bfloat16, 32)
    layer.quantize_rows(0, torch.randn(1536, 576, generator=torch.Generator().manual_seed(1)))
    scale, shift = scale_and_shift(layer.scales_and_zeros)
    x = torch.randn(40, 576, generator=torch.Generator().manual_seed(2)).bfloat16()
    whole = x.float() @ int4pack_dequant_t(ext, layer.packed, scale, shift, 32)
    for chunk in (512, 448, 64, 4096):  # 1536 columns: 3 chunks, 4 with a short last one, 24, 1
        torch.testing.assert_close(
            int4pack_linear(ext, x, layer.packed, scale, shift, 32, chunk), whole, rtol=1e-5, atol=1e-5
        )


def test_refuses_bad_shapes(ext):
    packed = torch.zeros(64, 16, dtype=torch.uint8)
    scale = torch.zeros(1, 64)
    with pytest.raises(RuntimeError, match="group_size must divide K"):
        ext.int4pack_dequant_t(packed, scale, scale, 5, 64)
    with pytest.raises(RuntimeError, match="block_n must be 32 or 64"):
        ext.int4pack_dequant_t(packed, scale, scale, 32, 16)
    with pytest.raises(RuntimeError, match="multiple of block_n"):
        ext.int4pack_dequant_t(torch.zeros(32, 16, dtype=torch.uint8), scale, scale, 32, 64)
    with pytest.raises(RuntimeError, match=r"scale must be \[K / group_size, N\]"):
        ext.int4pack_dequant_t(packed, torch.zeros(2, 64), torch.zeros(2, 64), 32, 64)
    with pytest.raises(RuntimeError, match="multiples of block_n"):
        ext.int4pack_dequant_t_into(packed, scale, scale, 32, 64, 0, 32, torch.zeros(32, 32))
