"""The shared MoE block (pagedserve.engine.model.moe) against a float64 per-token reference: routing of each
kind, grouped experts with and without a gated shared expert, in float64 / float32 / bfloat16;
every chosen expert runs once per step over all its tokens; the fused SiLU op changes nothing."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from pagedserve.engine.model.layers.moe import MoESpec, RouterScoring, SparseMoeBlock, group_by_expert, route
from pagedserve.kernels.cpu_fused_ops import load_fused_ops

HIDDEN = 48


def reference_route(logits: torch.Tensor, top_k: int, scoring: RouterScoring, normalize: bool):
    """Routing as the checkpoints' own code states it, in float64, one token at a time."""
    weights, ids = [], []
    for row in logits.double():
        if scoring is RouterScoring.TOPK_SOFTMAX:  # Mixtral: softmax over the top-k logits
            top = torch.topk(row, top_k)
            w = torch.softmax(top.values, dim=0)
        else:
            top = torch.topk(torch.softmax(row, dim=0), top_k)
            w = top.values / top.values.sum() if normalize else top.values
        weights.append(w)
        ids.append(top.indices)
    return torch.stack(weights), torch.stack(ids)


def reference_block(block: SparseMoeBlock, h: torch.Tensor) -> torch.Tensor:
    """The block's output in float64 from its weights, looping over tokens and their experts."""
    spec = block.spec
    h = h.double()

    def mlp(expert, x):
        gate, up = (expert.gate_up_proj.weight.double() @ x).chunk(2)
        return expert.down_proj.weight.double() @ (F.silu(gate) * up)

    out = []
    for x in h:
        logits = block.gate.weight.double() @ x
        w, ids = reference_route(logits[None], spec.top_k, spec.scoring, spec.normalize)
        y = sum(w[0, j] * mlp(block.experts[int(ids[0, j])], x) for j in range(spec.top_k))
        if block.shared_expert is not None:
            shared = mlp(block.shared_expert, x)
            if block.shared_expert_gate is not None:
                shared = torch.sigmoid(block.shared_expert_gate.weight.double() @ x) * shared
            y = y + shared
        out.append(y)
    return torch.stack(out)


def make_block(spec: MoESpec, dtype: torch.dtype, seed: int = 0, ops=None, hidden: int = HIDDEN) -> SparseMoeBlock:
    torch.manual_seed(seed)
    block = SparseMoeBlock(hidden, spec, dtype, ops)
    with torch.no_grad():
        for p in block.parameters():
            p.copy_(torch.randn(p.shape, dtype=torch.float64) * p.shape[-1] ** -0.5)
    return block.requires_grad_(False)


SPECS = {
    "qwen2_moe": MoESpec(
        8, 2, 32, RouterScoring.SOFTMAX_TOPK, normalize=False, shared_intermediate_size=40, shared_gate=True
    ),
    "qwen3_moe": MoESpec(8, 3, 32, RouterScoring.SOFTMAX_TOPK, normalize=True),
    "mixtral": MoESpec(4, 2, 64, RouterScoring.TOPK_SOFTMAX, normalize=True),
    "olmoe": MoESpec(16, 4, 16, RouterScoring.SOFTMAX_TOPK, normalize=False),
    "shared_ungated": MoESpec(4, 1, 16, RouterScoring.SOFTMAX_TOPK, normalize=True, shared_intermediate_size=24),
}


@pytest.mark.parametrize("scoring", list(RouterScoring))
@pytest.mark.parametrize("normalize", [False, True])
def test_route_matches_the_float64_reference(scoring, normalize):
    torch.manual_seed(1)
    logits = torch.randn(33, 8) * 3
    weights, ids = route(logits, 3, scoring, normalize)
    ref_w, ref_ids = reference_route(logits, 3, scoring, normalize)
    assert weights.dtype == torch.float32 and ids.dtype == torch.int64
    assert torch.equal(ids, ref_ids)
    torch.testing.assert_close(weights.double(), ref_w, rtol=1e-6, atol=1e-7)
    sums = weights.sum(-1)
    if scoring is RouterScoring.TOPK_SOFTMAX or normalize:
        torch.testing.assert_close(sums, torch.ones_like(sums))
    else:
        assert (sums < 1).all()


def test_mixtral_topk_softmax_equals_softmax_topk_renormalized():
    # transformers writes Mixtral's router as softmax over all, top-k, renormalize: the same weights.
    logits = torch.randn(64, 8, generator=torch.Generator().manual_seed(2))
    a = route(logits, 2, RouterScoring.TOPK_SOFTMAX, True)
    b = route(logits, 2, RouterScoring.SOFTMAX_TOPK, True)
    assert torch.equal(a[1], b[1])
    torch.testing.assert_close(a[0], b[0], rtol=1e-6, atol=1e-7)


def test_group_by_expert_sorts_pairs_stably_by_expert():
    ids = torch.tensor([[2, 0], [0, 3], [2, 3], [1, 2]])
    groups = group_by_expert(ids, 5)
    assert groups.counts == [2, 1, 3, 2, 0]
    assert groups.tokens.tolist() == [0, 1, 3, 0, 2, 3, 1, 2]
    assert ids.reshape(-1)[groups.order].tolist() == [0, 0, 1, 2, 2, 2, 3, 3]


@pytest.mark.parametrize("name", list(SPECS))
@pytest.mark.parametrize("tokens", [1, 7, 64])
def test_block_matches_the_float64_reference(name, tokens):
    block = make_block(SPECS[name], torch.float64)
    h = torch.randn(tokens, HIDDEN, dtype=torch.float64, generator=torch.Generator().manual_seed(tokens))
    torch.testing.assert_close(block(h), reference_block(block, h), rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize("name", list(SPECS))
@pytest.mark.parametrize(("dtype", "tol"), [(torch.float32, 2e-5), (torch.bfloat16, 3e-2)])
def test_block_in_float32_and_bfloat16_is_close_to_the_float64_reference(name, dtype, tol):
    block = make_block(SPECS[name], dtype)
    h = torch.randn(40, HIDDEN, generator=torch.Generator().manual_seed(3)).to(dtype)
    out = block(h)
    assert out.dtype == dtype
    ref = reference_block(block, h)
    # A bf16 router may pick another expert where two weights are within its rounding: compare
    # the rows whose float64 choice is well separated (all of them, for float32).
    logits = h.double() @ block.gate.weight.double().T
    w, _ = reference_route(logits, block.spec.num_experts, block.spec.scoring, False)
    k = block.spec.top_k
    margin = w[:, k - 1] - w[:, k] if k < block.spec.num_experts else torch.ones(len(h), dtype=torch.float64)
    clear = margin > (1e-2 if dtype == torch.bfloat16 else 0)
    assert clear.sum() >= len(h) // 2
    torch.testing.assert_close(out.double()[clear], ref[clear], rtol=tol, atol=tol)


def test_each_chosen_expert_runs_once_per_step_over_all_its_tokens():
    block = make_block(SPECS["qwen2_moe"], torch.float32)
    calls: list[tuple[int, int]] = []
    for e, expert in enumerate(block.experts):
        expert.register_forward_hook(lambda mod, args, out, e=e: calls.append((e, args[0].shape[0])))
    h = torch.randn(32, HIDDEN, generator=torch.Generator().manual_seed(4))
    block(h)
    _, ids = route(block.gate(h), 2, RouterScoring.SOFTMAX_TOPK, False)
    expected = torch.bincount(ids.reshape(-1), minlength=8)
    assert [e for e, _ in calls] == sorted(set(ids.reshape(-1).tolist()))  # each at most once, in order
    assert {e: n for e, n in calls} == {e: int(n) for e, n in enumerate(expected) if n}


def test_fused_silu_gives_bit_identical_results():
    ops = load_fused_ops()
    if ops is None:
        pytest.skip("the fused_ops extension cannot be built here")
    h = torch.randn(24, HIDDEN, generator=torch.Generator().manual_seed(5))
    for dtype in (torch.float32, torch.bfloat16):
        plain = make_block(SPECS["qwen2_moe"], dtype)
        fused = make_block(SPECS["qwen2_moe"], dtype, ops=ops)
        assert torch.equal(plain(h.to(dtype)), fused(h.to(dtype)))


def test_tensor_parallel_slices_sum_to_the_whole_block():
    """Two ranks' blocks, each with half of every expert's intermediate size (and of the shared
    expert's), sum to the whole block: what the all-reduce of `reduce` completes."""
    spec = SPECS["qwen2_moe"]
    whole = make_block(spec, torch.float64)
    half = MoESpec(
        spec.num_experts,
        spec.top_k,
        spec.intermediate_size // 2,
        spec.scoring,
        spec.normalize,
        spec.shared_intermediate_size // 2,
        spec.shared_gate,
    )
    parts = []
    for rank in range(2):
        part = SparseMoeBlock(HIDDEN, half, torch.float64).requires_grad_(False)
        part.gate.weight.copy_(whole.gate.weight)
        part.shared_expert_gate.weight.copy_(whole.shared_expert_gate.weight)
        for src, dst in [*zip(whole.experts, part.experts), (whole.shared_expert, part.shared_expert)]:
            n = dst.down_proj.in_features
            gate, up = src.gate_up_proj.weight.chunk(2)
            dst.gate_up_proj.weight.copy_(torch.cat([gate[rank * n : (rank + 1) * n], up[rank * n : (rank + 1) * n]]))
            dst.down_proj.weight.copy_(src.down_proj.weight[:, rank * n : (rank + 1) * n])
        parts.append(part)
    h = torch.randn(16, HIDDEN, dtype=torch.float64, generator=torch.Generator().manual_seed(6))
    torch.testing.assert_close(parts[0](h) + parts[1](h), whole(h), rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"num_experts": 4, "top_k": 5}, "num_experts_per_tok 5 must be between 1 and the 4 experts"),
        ({"num_experts": 4, "top_k": 0}, "num_experts_per_tok 0"),
        ({"intermediate_size": 0}, "expert intermediate sizes must be positive"),
        ({"shared_gate": True}, "a shared expert gate needs a shared expert"),
    ],
)
def test_spec_refuses_inconsistent_sizes(kwargs, message):
    base = {
        "num_experts": 4,
        "top_k": 2,
        "intermediate_size": 8,
        "scoring": RouterScoring.SOFTMAX_TOPK,
        "normalize": True,
    }
    with pytest.raises(ValueError, match=message):
        MoESpec(**{**base, **kwargs})
