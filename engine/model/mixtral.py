"""Mixtral: the Mistral layout (optional sliding window on every layer) whose MLPs are sparse
blocks routed top-k-then-softmax (the k largest logits, softmax over them). Its checkpoint names
the block `block_sparse_moe` and an expert's projections w1 (gate), w3 (up), w2 (down)."""

from __future__ import annotations

import re
from collections.abc import Mapping
from typing import Any

from pagedserve.engine.model.family import Family
from pagedserve.engine.model.layers.moe import MoESpec, RouterScoring
from pagedserve.engine.model.moe_lm import MoECausalLM, num_experts
from pagedserve.engine.model.spec import ModelSpec, base_fields

_EXPERT = re.compile(r"\.block_sparse_moe\.experts\.(\d+)\.(w1|w2|w3)\.")
_PROJ = {"w1": "gate_proj", "w3": "up_proj", "w2": "down_proj"}


class MixtralForCausalLM(MoECausalLM):
    @staticmethod
    def checkpoint_name(name: str) -> str:
        """`...block_sparse_moe.experts.3.w1.weight` -> `...mlp.experts.3.gate_proj.weight`;
        `...block_sparse_moe.gate.weight` -> `...mlp.gate.weight`."""
        name = _EXPERT.sub(lambda m: f".mlp.experts.{m.group(1)}.{_PROJ[m.group(2)]}.", name)
        return name.replace(".block_sparse_moe.gate.", ".mlp.gate.")


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
    MixtralForCausalLM,
    tensor_parallel=True,
    notes="experts routed top-k then softmax, optional sliding window",
)
