"""Phi-3: the Llama layout whose checkpoint already fuses q/k/v (`qkv_proj`) and gate/up
(`gate_up_proj`), LongRoPE scaling (short factors below the original context, long ones past
it), and an optional sliding window on every layer."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from pagedserve.engine.model.family import Family
from pagedserve.engine.model.spec import ModelSpec, base_fields


def parse_phi3(cfg: Mapping[str, Any], arch: str) -> ModelSpec:
    fields = base_fields(cfg, arch)
    window = cfg.get("sliding_window")
    fields.update(qkv_bias=False, sliding_window=None if window is None else int(window))
    return ModelSpec(**fields)


PHI3 = Family(
    "phi3",
    ("Phi3ForCausalLM",),
    ("phi3",),
    parse_phi3,
    "causal_lm.Phi3ForCausalLM",
    gguf_architectures=("phi3",),
    tensor_parallel=True,
    notes="fused qkv and gate_up checkpoint, LongRoPE",
)
