"""The Llama family: Llama (2, 3 with its rope scaling), Mistral (a sliding window on every
layer) and Qwen2 (q/k/v biases; sliding layers from `layer_types`). The shared decoder
(pagedserve.engine.model.causal_lm) is exactly this family; only the config parsing differs."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from pagedserve.engine.model.family import Family
from pagedserve.engine.model.spec import ModelSpec, base_fields, layer_types_of


def sliding_fields(cfg: Mapping[str, Any]) -> dict[str, Any]:
    """Qwen's optional sliding layers: `layer_types` when it names any, else `use_sliding_window`
    (every layer from `max_window_layers` on slides, as transformers derives it)."""
    types = layer_types_of(cfg)
    if types is not None and "sliding_attention" in types:
        return {"sliding_window": int(cfg["sliding_window"]), "layer_types": types}
    if cfg.get("use_sliding_window") and cfg.get("sliding_window"):
        first = int(cfg.get("max_window_layers", 0))
        types = tuple(
            "sliding_attention" if i >= first else "full_attention" for i in range(int(cfg["num_hidden_layers"]))
        )
        if "sliding_attention" in types:
            return {"sliding_window": int(cfg["sliding_window"]), "layer_types": types}
    return {}


def parse_llama(cfg: Mapping[str, Any], arch: str) -> ModelSpec:
    fields = base_fields(cfg, arch)
    bias = bool(cfg.get("attention_bias", False))
    if arch == "LlamaForCausalLM":
        fields.update(o_bias=bias, mlp_bias=bool(cfg.get("mlp_bias", False)))
    elif arch == "MistralForCausalLM":
        fields.update(qkv_bias=False, sliding_window=cfg.get("sliding_window"))
    else:  # Qwen2
        fields.update(qkv_bias=True, **sliding_fields(cfg))
    return ModelSpec(**fields)


LLAMA = Family(
    "llama",
    ("LlamaForCausalLM",),
    ("llama",),
    parse_llama,
    "causal_lm.LlamaForCausalLM",
    gguf_architectures=("llama",),
    tensor_parallel=True,
    notes="rope scaling: linear, llama3",
)
MISTRAL = Family(
    "mistral",
    ("MistralForCausalLM",),
    ("mistral",),
    parse_llama,
    "causal_lm.LlamaForCausalLM",
    gguf_architectures=("mistral",),
    tensor_parallel=True,
    notes="sliding window on every layer",
)
QWEN2 = Family(
    "qwen2",
    ("Qwen2ForCausalLM",),
    ("qwen2",),
    parse_llama,
    "causal_lm.LlamaForCausalLM",
    gguf_architectures=("qwen2",),
    tensor_parallel=True,
    notes="q/k/v biases",
)
