"""The CPU fused decoder ops against their plain-torch references (the model's torch code).

The kernels replay torch's rounding (per-op bf16 rounding, the float32 sum order of the RMSNorm
mean, Sleef's exp on SiLU's vector chunks), so results must be bit-identical in both dtypes.
"""

from __future__ import annotations

import pytest
import torch

from pagedserve.kernels.cpu_fused_ops import (
    load_fused_ops,
    reference_fused_add_rms_norm,
    reference_rms_norm,
    reference_rotary_embedding,
    reference_silu_and_mul,
)
from tests.kernels import built_or_skip

DTYPES = [torch.float32, torch.bfloat16]
# 576: SmolLM2's hidden size; the others are off every vector width, or long enough for the
# cascaded sum to use several levels.
NORM_SIZES = [1, 7, 16, 63, 576, 1000, 4099, 70000]


@pytest.fixture(scope="module")
def ops():
    return built_or_skip(load_fused_ops, "fused_ops")


def _randn(*shape, dtype, seed, scale=1.0):
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(*shape, generator=g) * scale).to(dtype)


def _assert_same(actual, expected):
    assert actual.dtype == expected.dtype and actual.shape == expected.shape
    assert torch.equal(actual, expected), (actual.float() - expected.float()).abs().max()


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("n", NORM_SIZES)
def test_rms_norm(ops, dtype, n):
    rows = 3 if n > 5000 else 37
    x = _randn(rows, n, dtype=dtype, seed=n, scale=3.0)
    w = _randn(n, dtype=dtype, seed=n + 1)
    _assert_same(ops.rms_norm(x, w, 1e-5), reference_rms_norm(x, w, 1e-5))


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("n", NORM_SIZES)
def test_fused_add_rms_norm(ops, dtype, n):
    rows = 3 if n > 5000 else 37
    x = _randn(rows, n, dtype=dtype, seed=n, scale=2.0)
    residual = _randn(rows, n, dtype=dtype, seed=n + 1, scale=5.0)
    w = _randn(n, dtype=dtype, seed=n + 2)
    expected, expected_residual = reference_fused_add_rms_norm(x, residual, w, 1e-6)
    out = ops.fused_add_rms_norm(x, residual, w, 1e-6)  # updates residual in place
    _assert_same(residual, expected_residual)
    _assert_same(out, expected)


def test_rms_norm_keeps_leading_dims(ops):
    x = _randn(2, 5, 64, dtype=torch.bfloat16, seed=0)
    w = _randn(64, dtype=torch.bfloat16, seed=1)
    _assert_same(ops.rms_norm(x, w, 1e-5), reference_rms_norm(x, w, 1e-5))


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("rows, n", [(1, 1), (5, 17), (64, 20), (64, 40), (64, 1536), (3, 45), (7, 100), (2, 33)])
def test_silu_and_mul(ops, dtype, rows, n):
    """Sizes around torch's vector chunks (32 float32 / 64 bf16 with AVX512): exp differs in the tail."""
    gate_up = _randn(rows, 2 * n, dtype=dtype, seed=n, scale=4.0)
    _assert_same(ops.silu_and_mul(gate_up), reference_silu_and_mul(gate_up))


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("tokens, heads, total_heads, head_dim", [(5, 12, 15, 64), (1, 1, 1, 2), (9, 3, 7, 10)])
def test_rotary_embedding_in_place(ops, dtype, tokens, heads, total_heads, head_dim):
    """RoPE on the first `heads` of a fused [T, total_heads * D] row, like q|k inside qkv."""
    qkv = _randn(tokens, total_heads * head_dim, dtype=dtype, seed=head_dim, scale=3.0)
    angles = torch.rand(tokens, 1, head_dim // 2, generator=torch.Generator().manual_seed(1)) * 50
    cos, sin = angles.cos().to(dtype), angles.sin().to(dtype)
    view = qkv[:, : heads * head_dim].view(tokens, heads, head_dim)
    expected = reference_rotary_embedding(view, cos, sin)
    untouched = qkv[:, heads * head_dim :].clone()
    ops.rotary_embedding_(view, cos, sin)
    _assert_same(qkv[:, : heads * head_dim].view(tokens, heads, head_dim), expected)
    assert torch.equal(qkv[:, heads * head_dim :], untouched)


def test_launchers_reject_bad_inputs(ops):
    x = torch.randn(4, 8)
    with pytest.raises(ValueError):
        ops.rms_norm(x, torch.randn(8, dtype=torch.bfloat16), 1e-5)
    with pytest.raises(ValueError):
        ops.fused_add_rms_norm(x, torch.randn(4, 9), torch.randn(8), 1e-5)
    with pytest.raises(ValueError):
        ops.silu_and_mul(torch.randn(4, 7))
    with pytest.raises(ValueError):
        ops.rotary_embedding_(torch.randn(4, 2, 8), torch.randn(4, 1, 3), torch.randn(4, 1, 3))
    with pytest.raises(ValueError):
        ops.rms_norm(x.double(), torch.randn(8).double(), 1e-5)
