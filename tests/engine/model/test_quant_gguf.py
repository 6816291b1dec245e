"""GGUF blocks decoded in torch equal the `gguf` package's de-quantizers bit for bit."""

from __future__ import annotations

import gguf
import numpy as np
import pytest
import torch

from pagedserve.engine.model.default_model import default_gguf_path
from pagedserve.engine.model.gguf_blocks import GGUFBlockType, decode, int4_groups

QUANTIZABLE = [GGUFBlockType.Q4_0, GGUFBlockType.Q4_1, GGUFBlockType.Q8_0]  # gguf quantizes these


def _random_raw(kind: GGUFBlockType, rows: int = 8, cols: int = 512) -> np.ndarray:
    data = np.random.default_rng(0).standard_normal((rows, cols)).astype(np.float32)
    data[0] *= 1e-3  # small and large scales
    data[1] *= 40
    return gguf.quants.quantize(data, gguf.GGMLQuantizationType[kind.value])


def _random_kquant(kind: GGUFBlockType, rows: int = 8, supers: int = 3) -> np.ndarray:
    """K-quant blocks gguf cannot make: random bytes with finite half-float scales."""
    rng = np.random.default_rng(1)
    _, nbytes = kind.block
    raw = rng.integers(0, 256, size=(rows, supers, nbytes), dtype=np.uint8)
    # two half floats per super-block: Q4_K's d and dmin (bytes 0..3); Q6_K's d is its last 2 bytes
    scales = rng.uniform(1e-4, 0.05, size=(rows, supers, 2)).astype(np.float16).view(np.uint8)
    if kind is GGUFBlockType.Q4_K:
        raw[..., 0:4] = scales
    else:
        raw[..., 208:210] = scales[..., :2]
    return raw.reshape(rows, -1)


def _assert_same(raw: np.ndarray, kind: GGUFBlockType) -> None:
    want = gguf.quants.dequantize(raw, gguf.GGMLQuantizationType[kind.value])
    got = decode(torch.from_numpy(raw), kind)
    assert got.dtype == torch.float32 and tuple(got.shape) == want.shape
    assert torch.equal(got.view(torch.int32), torch.from_numpy(np.ascontiguousarray(want)).view(torch.int32))


@pytest.mark.parametrize("kind", QUANTIZABLE, ids=lambda k: k.value)
def test_decode_matches_gguf_on_quantized_random_data(kind):
    _assert_same(_random_raw(kind), kind)


@pytest.mark.parametrize("kind", [GGUFBlockType.Q4_K, GGUFBlockType.Q6_K], ids=lambda k: k.value)
def test_decode_matches_gguf_on_k_quant_blocks(kind):
    _assert_same(_random_kquant(kind), kind)


def test_decode_matches_gguf_on_the_bundled_file():
    reader = gguf.GGUFReader(default_gguf_path())
    checked = set()
    for tensor in reader.tensors:
        kind = GGUFBlockType.__members__.get(tensor.tensor_type.name)
        if kind is None or kind in checked:
            continue
        _assert_same(np.array(tensor.data), kind)
        checked.add(kind)
    assert checked == {GGUFBlockType.Q4_1, GGUFBlockType.Q8_0}


@pytest.mark.parametrize("kind", [GGUFBlockType.Q4_0, GGUFBlockType.Q4_1, GGUFBlockType.Q4_K], ids=lambda k: k.value)
def test_int4_groups_hold_exactly_the_decoded_values(kind):
    raw = _random_kquant(kind) if kind is GGUFBlockType.Q4_K else _random_raw(kind)
    raw = torch.from_numpy(raw)
    codes, scale, offset = int4_groups(raw, kind)
    assert codes.dtype == torch.uint8 and int(codes.max()) <= 15
    values = codes.float().view(codes.shape[0], -1, 32) * scale[..., None] + offset[..., None]
    assert torch.equal(values.reshape(codes.shape), decode(raw, kind))


def test_bad_input_is_refused():
    with pytest.raises(ValueError, match="whole 18-byte blocks"):
        decode(torch.zeros(2, 20, dtype=torch.uint8), GGUFBlockType.Q4_0)
    with pytest.raises(ValueError, match="not a 4-bit type"):
        int4_groups(torch.zeros(2, 34, dtype=torch.uint8), GGUFBlockType.Q8_0)


def test_a_type_with_no_decoder_is_refused_naming_the_tensor():
    """Q8_1 has no decoder here and gguf cannot de-quantize it either: a clear error, no fallback."""
    from types import SimpleNamespace

    from pagedserve.engine.model.quant_convert import _float

    raw = torch.zeros(1, gguf.GGML_QUANT_SIZES[gguf.GGMLQuantizationType.Q8_1][1], dtype=torch.uint8)
    with pytest.raises(ValueError, match=r"blk\.0\.attn_q\.weight: type Q8_1 has no decoder.*native: Q4_0"):
        _float(raw, "Q8_1", SimpleNamespace(name="blk.0.attn_q.weight"))
