"""OLMoE: pre-norm layers whose q and k projections are each RMS-normed as a whole (over all
heads, not per head) before RoPE, and whose MLPs are sparse blocks with softmax top-k routing
(raw weights unless `norm_topk_prob`). `clip_qkv` is refused. Under tensor parallelism the q/k
norms are split with the heads, their mean of squares all-reduced
(pagedserve.engine.model.layers.parallel.SplitRMSNorm)."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from pagedserve.engine.model.family import Family
from pagedserve.engine.model.spec import ModelSpec, MoESpec, RouterScoring, base_fields, num_experts


def parse_olmoe(cfg: Mapping[str, Any], arch: str) -> ModelSpec:
    if cfg.get("clip_qkv") is not None:
        raise ValueError(f"clip_qkv={cfg['clip_qkv']} is not supported for {arch}; supported: clip_qkv null")
    fields = base_fields(cfg, arch)
    moe = MoESpec(
        num_experts=num_experts(cfg),
        top_k=int(cfg["num_experts_per_tok"]),
        intermediate_size=int(cfg["intermediate_size"]),
        scoring=RouterScoring.SOFTMAX_TOPK,
        normalize=bool(cfg.get("norm_topk_prob", False)),
    )
    bias = bool(cfg.get("attention_bias", False))
    fields.update(qk_norm=True, qk_norm_full=True, qkv_bias=bias, o_bias=bias, moe=moe)
    return ModelSpec(**fields)


OLMOE = Family(
    "olmoe",
    ("OlmoeForCausalLM",),
    ("olmoe",),
    parse_olmoe,
    "moe_lm.OlmoeForCausalLM",
    tensor_parallel=True,
    notes="experts with softmax top-k routing, q/k RMSNorm over whole projections",
)
