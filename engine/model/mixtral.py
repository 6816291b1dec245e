"""Mixtral: the Mistral layout (optional sliding window on every layer) whose MLPs are sparse
blocks routed top-k-then-softmax (the k largest logits, softmax over them). Its checkpoint names
the block `block_sparse_moe` and an expert's projections w1 (gate), w3 (up), w2 (down)."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from pagedserve.engine.model.family import Family
from pagedserve.engine.model.spec import ModelSpec, MoESpec, RouterScoring, base_fields, num_experts


def parse_mixtral(cfg: Mapping[str, Any], arch: str) -> ModelSpec:
    fields = base_fields(cfg, arch)
    moe = MoESpec(
        num_experts=num_experts(cfg),
        top_k=int(cfg["num_experts_per_tok"]),
        intermediate_size=int(cfg["intermediate_size"]),
        scoring=RouterScoring.TOPK_SOFTMAX,
        normalize=True,
    )
    window = cfg.get("sliding_window")
    fields.update(qkv_bias=False, sliding_window=None if window is None else int(window), moe=moe)
    return ModelSpec(**fields)


MIXTRAL = Family(
    "mixtral",
    ("MixtralForCausalLM",),
    ("mixtral",),
    parse_mixtral,
    "moe_lm.MixtralForCausalLM",
    tensor_parallel=True,
    notes="experts routed top-k then softmax, optional sliding window",
)
