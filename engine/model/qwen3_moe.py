"""Qwen3-MoE: the Qwen3 layout (per-head q/k RMSNorm) whose MLPs are sparse blocks with softmax
top-k routing (weights renormalized when `norm_topk_prob`), no shared expert; layers in
`mlp_only_layers` or off the `decoder_sparse_step` grid keep a dense MLP."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from pagedserve.engine.model.family import Family
from pagedserve.engine.model.llama import sliding_fields
from pagedserve.engine.model.spec import ModelSpec, MoESpec, RouterScoring, base_fields, num_experts, qwen_dense_layers


def parse_qwen3_moe(cfg: Mapping[str, Any], arch: str) -> ModelSpec:
    fields = base_fields(cfg, arch)
    moe = MoESpec(
        num_experts=num_experts(cfg),
        top_k=int(cfg["num_experts_per_tok"]),
        intermediate_size=int(cfg["moe_intermediate_size"]),
        scoring=RouterScoring.SOFTMAX_TOPK,
        normalize=bool(cfg.get("norm_topk_prob", False)),
        dense_layers=qwen_dense_layers(cfg),
    )
    bias = bool(cfg.get("attention_bias", False))
    fields.update(qk_norm=True, qkv_bias=bias, o_bias=bias, moe=moe, **sliding_fields(cfg))
    return ModelSpec(**fields)


QWEN3_MOE = Family(
    "qwen3_moe",
    ("Qwen3MoeForCausalLM",),
    ("qwen3_moe",),
    parse_qwen3_moe,
    "moe_lm.Qwen3MoeForCausalLM",
    gguf_architectures=("qwen3moe",),
    tensor_parallel=True,
    notes="experts with softmax top-k routing, per-head q/k RMSNorm",
)
