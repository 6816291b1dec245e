"""The sparse mixture-of-experts block shared by the MoE families (Qwen2-MoE, Qwen3-MoE, Mixtral, OLMoE).

A router (`gate`, a linear layer to one logit per expert) picks `top_k` experts per token and
their weights; the block's output is the weighted sum of those experts' SwiGLU MLPs, plus (Qwen2-
MoE) a shared expert that every token goes through, scaled by `sigmoid(shared_expert_gate(h))`.

Experts run as a server runs them (sort-and-segment): the step's (token, expert) pairs are sorted
by expert, the tokens gathered once into that order, and each expert that received any token runs
one GEMM pair over its contiguous segment, so every expert's weights are read once per step
whatever the batch, and the Python loop is over experts (at most `num_experts` iterations), never
over tokens. The weighted results are summed back per token with one `index_add_` in expert
order, the order transformers adds them in.

Each expert is a pair of ordinary projections (`gate_up_proj` rows gate|up, `down_proj`), so the
model's quantized layers (pagedserve.engine.model.quant_linear) and CPU packing apply to experts as they do
to any projection; the router and the shared expert's gate (one output) stay in the model dtype.

Tensor parallelism (pagedserve.engine.parallel): every rank holds every expert, each with its slice of the
expert's intermediate size (rows of gate/up, columns of down), like the dense MLP; the router is
replicated, so all ranks route identically, and one all-reduce (`reduce`) sums the ranks' partial
outputs of the routed and shared experts together.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from pagedserve.engine.lora.punica import LoRALayer
from pagedserve.engine.model.layers.norm import eager_ops
from pagedserve.engine.model.spec import MoESpec, RouterScoring
from pagedserve.kernels.cpu_fused_ops import CpuFusedOps


def route(
    logits: torch.Tensor, top_k: int, scoring: RouterScoring, normalize: bool
) -> tuple[torch.Tensor, torch.Tensor]:
    """`logits [T, E]` -> (weights `[T, k]`, expert ids int64 `[T, k]`). The weights are float32
    as transformers computes them (float64 for float64 logits, the tests' reference precision)."""
    dtype = torch.promote_types(logits.dtype, torch.float32)
    if scoring is RouterScoring.TOPK_SOFTMAX:
        top, ids = torch.topk(logits.to(dtype), top_k, dim=-1)
        return torch.softmax(top, dim=-1), ids
    weights, ids = torch.topk(torch.softmax(logits, dim=-1, dtype=dtype), top_k, dim=-1)
    if normalize:
        weights = weights / weights.sum(dim=-1, keepdim=True)
    return weights, ids


@dataclass(frozen=True, slots=True)
class ExpertGroups:
    """A step's (token, expert) pairs in expert order: pair `order[i]` of the flattened `[T, k]`
    choice goes to token `tokens[i]`; expert `e` owns the next `counts[e]` pairs."""

    order: torch.Tensor  # int64 [T * k]
    tokens: torch.Tensor  # int64 [T * k]
    counts: list[int]  # [E]


def group_by_expert(ids: torch.Tensor, num_experts: int) -> ExpertGroups:
    """Sort the choices `ids [T, k]` by expert (stably: tokens stay in order within an expert)."""
    flat = ids.reshape(-1)
    order = torch.argsort(flat, stable=True)
    counts = torch.bincount(flat, minlength=num_experts).tolist()
    return ExpertGroups(order, order // ids.shape[1], counts)


class ExpertMLP(nn.Module):
    """One SwiGLU expert: `down(silu(gate(x)) * up(x))`, gate and up fused as `gate_up_proj`."""

    def __init__(
        self, hidden_size: int, intermediate_size: int, dtype: torch.dtype, ops: CpuFusedOps | None = None
    ) -> None:
        super().__init__()
        self.gate_up_proj = nn.Linear(hidden_size, 2 * intermediate_size, bias=False, dtype=dtype)
        self.down_proj = nn.Linear(intermediate_size, hidden_size, bias=False, dtype=dtype)
        self.ops = ops

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate_up = self.gate_up_proj(x)
        ops = eager_ops(self.ops)
        if ops:
            act = ops.silu_and_mul(gate_up)
        else:
            gate, up = gate_up.chunk(2, dim=-1)
            act = F.silu(gate) * up
        return self.down_proj(act)


class SparseMoeBlock(nn.Module):
    """Router + experts (+ gated shared expert); `forward(h [T, hidden]) -> [T, hidden]`.
    LoRA adapters do not reach experts: the engine refuses them for MoE models.

    Module names follow the Qwen2-MoE / OLMoE checkpoints (`gate`, `experts.{e}`,
    `shared_expert`, `shared_expert_gate`); families with other names map theirs onto these.
    """

    def __init__(self, hidden_size: int, spec: MoESpec, dtype: torch.dtype, ops: CpuFusedOps | None = None) -> None:
        super().__init__()
        self.spec = spec
        self.gate = nn.Linear(hidden_size, spec.num_experts, bias=False, dtype=dtype)
        self.experts = nn.ModuleList(
            ExpertMLP(hidden_size, spec.intermediate_size, dtype, ops) for _ in range(spec.num_experts)
        )
        self.shared_expert = (
            ExpertMLP(hidden_size, spec.shared_intermediate_size, dtype, ops) if spec.shared_intermediate_size else None
        )
        self.shared_expert_gate = nn.Linear(hidden_size, 1, bias=False, dtype=dtype) if spec.shared_gate else None
        # Tensor parallelism (pagedserve.engine.model.layers.parallel): sums the ranks' partial outputs.
        self.reduce: Callable[[torch.Tensor], torch.Tensor] | None = None

    def forward(self, h: torch.Tensor, lora: LoRALayer | None = None) -> torch.Tensor:
        if lora is not None:
            raise ValueError("LoRA adapters are not supported for mixture-of-experts layers")
        spec = self.spec
        weights, ids = route(self.gate(h), spec.top_k, spec.scoring, spec.normalize)
        out = self.run_experts(h, weights, ids)
        if self.shared_expert is not None:
            shared = self.shared_expert(h)
            if self.shared_expert_gate is not None:
                shared = torch.sigmoid(self.shared_expert_gate(h)) * shared
            out = out + shared
        return out if self.reduce is None else self.reduce(out)

    def run_experts(self, h: torch.Tensor, weights: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
        """`sum_j weights[t, j] * expert_{ids[t, j]}(h[t])` for every token `t`, by sort-and-segment."""
        groups = group_by_expert(ids, self.spec.num_experts)
        rows = h[groups.tokens]  # [T * k, hidden] in expert order: the one gather
        results = torch.empty_like(rows)
        start = 0
        for expert, count in zip(self.experts, groups.counts):
            if count:
                results[start : start + count] = expert(rows[start : start + count])
                start += count
        results *= weights.reshape(-1)[groups.order].to(results.dtype).unsqueeze(1)
        return torch.zeros_like(h).index_add_(0, groups.tokens, results)
