"""Gemma 3 (text): Gemma 2's layout (pagedserve.engine.model.gemma2) with q/k RMSNorms per head, no
soft-capping by default, five sliding layers to each global one, and the sliding layers' own
RoPE base (`rope_local_base_freq`, plain RoPE; the global layers keep the config's scaling)."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from pagedserve.engine.model.family import Family
from pagedserve.engine.model.gemma2 import gemma_fields
from pagedserve.engine.model.spec import ModelSpec, rope_params


def parse_gemma3(cfg: Mapping[str, Any], arch: str) -> ModelSpec:
    fields = gemma_fields(cfg, arch, pattern=int(cfg.get("sliding_window_pattern") or 6))
    theta, scaling = rope_params(cfg, "full_attention")
    if "rope_theta" not in cfg and not (cfg.get("rope_parameters") or {}).get("full_attention"):
        theta = 1_000_000.0  # Gemma 3's default global base
    local_theta, local_scaling = rope_params(cfg, "sliding_attention")
    if local_scaling is not None:
        raise ValueError(f"rope scaling on sliding layers ({local_scaling['rope_type']}) is not supported")
    if not (cfg.get("rope_parameters") or {}).get("sliding_attention"):
        local_theta = float(cfg.get("rope_local_base_freq") or 10_000.0)
    fields.update(qk_norm=True, rope_theta=theta, rope_scaling=scaling, local_rope_theta=local_theta)
    return ModelSpec(**fields)


GEMMA3 = Family(
    "gemma3",
    ("Gemma3ForCausalLM",),
    ("gemma3_text",),
    parse_gemma3,
    "causal_lm.Gemma3ForCausalLM",
    gguf_architectures=("gemma3",),
    tensor_parallel=True,
    notes="q/k norms, 5:1 sliding/global layers, local RoPE base on sliding layers",
)
