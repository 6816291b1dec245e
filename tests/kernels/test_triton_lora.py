"""The Triton LoRA BGMV kernels against their plain-torch reference, and against the engine's
CPU path (pagedserve.engine.lora.punica) on the same stacked slots.

Without a GPU the kernels run in Triton's interpreter (tests/conftest.py sets TRITON_INTERPRET),
so shapes stay tiny.
"""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("triton")

from pagedserve.kernels.triton_lora import bgmv_expand, bgmv_reference, bgmv_shrink

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


def _inputs(dtype, tokens=7, k=24, n=40, rank=8, slots=3, seed=0):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(tokens, k, generator=g).to(dtype)
    a = torch.randn(slots * rank, k, generator=g).to(dtype)
    b = torch.randn(n, slots * rank, generator=g).to(dtype)
    out = torch.randn(tokens, n, generator=g).to(dtype)
    idx = torch.tensor([2, -1, 0, 0, 1, -1, 2][:tokens], dtype=torch.int32)
    return [t.to(DEVICE) for t in (x, a, b, idx, out)]


@pytest.mark.parametrize("dtype,atol", [(torch.float32, 1e-4), (torch.float16, 3e-2), (torch.bfloat16, 1.5e-1)])
def test_shrink_then_expand_equals_the_reference(dtype, atol):
    x, a, b, idx, out = _inputs(dtype)
    expected = bgmv_reference(x, a, b, idx, 8, out)
    y = bgmv_shrink(x, a, idx, 8)
    assert torch.equal(y[idx < 0].float(), torch.zeros_like(y[idx < 0].float()))  # base rows: no delta
    before = out.clone()
    got = bgmv_expand(y, b, idx, out)
    assert got is out
    assert torch.equal(out[idx < 0], before[idx < 0])  # rows without an adapter are left as they were
    torch.testing.assert_close(out.float(), expected.float(), atol=atol, rtol=1e-2)


def test_launcher_refuses_bad_shapes():
    x, a, b, idx, out = _inputs(torch.float32)
    with pytest.raises(ValueError, match="a must be"):
        bgmv_shrink(x, a[:, :5], idx, 8)
    with pytest.raises(ValueError, match="bad shapes"):
        bgmv_shrink(x, a, idx[:3], 8)
    with pytest.raises(ValueError, match="b must be"):
        bgmv_expand(torch.zeros(7, 8, device=DEVICE), b[:5], idx, out)


def test_engine_batch_gives_the_same_delta_on_both_paths():
    """pagedserve.engine.lora.punica's torch path (dense shrink, one-hot mask, addmm) and its Triton path
    add the same LoRA delta to a fused projection's output."""
    from pagedserve.engine.lora.punica import LoRABatch
    from pagedserve.engine.lora.slots import GroupWeights

    x, a, b, idx, out = _inputs(torch.float32)
    layers = [{"qkv": GroupWeights(a, b, 8)}]
    for rows in ([2, -1, 0, 0, 1, -1, 2], [1] * 7, [-1, -1, 0, 0, 0, 0, 0]):
        expected = bgmv_reference(x, a, b, torch.tensor(rows), 8, out)
        for triton in (False, True):
            batch = LoRABatch.build(layers, rows, torch.float32, torch.device(DEVICE), use_triton=triton)
            got = batch.layer(0).add("qkv", x, out.clone())
            torch.testing.assert_close(got, expected, atol=1e-4, rtol=1e-4)
