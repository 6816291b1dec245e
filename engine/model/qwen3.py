"""Qwen3: the Llama layout with an RMSNorm over each query and key head before RoPE, no q/k/v
biases by default, and Qwen's optional sliding layers."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from pagedserve.engine.model.family import Family
from pagedserve.engine.model.llama import sliding_fields
from pagedserve.engine.model.spec import ModelSpec, base_fields


def parse_qwen3(cfg: Mapping[str, Any], arch: str) -> ModelSpec:
    fields = base_fields(cfg, arch)
    bias = bool(cfg.get("attention_bias", False))
    fields.update(qk_norm=True, qkv_bias=bias, o_bias=bias, **sliding_fields(cfg))
    return ModelSpec(**fields)


QWEN3 = Family(
    "qwen3",
    ("Qwen3ForCausalLM",),
    ("qwen3",),
    parse_qwen3,
    "causal_lm.Qwen3ForCausalLM",
    gguf_architectures=("qwen3",),
    tensor_parallel=True,
    notes="per-head q/k RMSNorm",
)
