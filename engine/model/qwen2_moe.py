"""Qwen2-MoE: the Qwen2 layout (q/k/v biases) whose MLPs are sparse blocks with softmax top-k
routing (raw weights unless `norm_topk_prob`) plus a shared expert scaled by a sigmoid gate;
layers in `mlp_only_layers` or off the `decoder_sparse_step` grid keep a dense MLP."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from pagedserve.engine.model.family import Family
from pagedserve.engine.model.llama import sliding_fields
from pagedserve.engine.model.spec import ModelSpec, MoESpec, RouterScoring, base_fields, num_experts, qwen_dense_layers


def parse_qwen2_moe(cfg: Mapping[str, Any], arch: str) -> ModelSpec:
    fields = base_fields(cfg, arch)
    moe = MoESpec(
        num_experts=num_experts(cfg),
        top_k=int(cfg["num_experts_per_tok"]),
        intermediate_size=int(cfg["moe_intermediate_size"]),
        scoring=RouterScoring.SOFTMAX_TOPK,
        normalize=bool(cfg.get("norm_topk_prob", False)),
        shared_intermediate_size=int(cfg["shared_expert_intermediate_size"]),
        shared_gate=True,
        dense_layers=qwen_dense_layers(cfg),
    )
    fields.update(qkv_bias=bool(cfg.get("qkv_bias", True)), moe=moe, **sliding_fields(cfg))
    return ModelSpec(**fields)


QWEN2_MOE = Family(
    "qwen2_moe",
    ("Qwen2MoeForCausalLM",),
    ("qwen2_moe",),
    parse_qwen2_moe,
    "moe_lm.Qwen2MoeForCausalLM",
    tensor_parallel=True,
    notes="experts with softmax top-k routing, gated shared expert",
)
