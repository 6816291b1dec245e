"""Gemma 2: sandwich norms (each block's output normed before its residual add), Gemma's
`(1 + w)` RMSNorm in float32, embeddings scaled by sqrt(hidden), scores scaled by
`query_pre_attn_scalar ** -0.5` and soft-capped, final logits soft-capped, GELU-tanh MLP, and
sliding-window layers alternating with global ones (`layer_types`, every other layer by default)."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from pagedserve.engine.model.family import Family
from pagedserve.engine.model.spec import ModelSpec, NormKind, base_fields, layer_types_of


def gemma_fields(cfg: Mapping[str, Any], arch: str, pattern: int) -> dict[str, Any]:
    """What Gemma 2 and 3 share; `pattern`: every pattern-th layer is global in configs
    without `layer_types`."""
    fields = base_fields(cfg, arch)
    bias = bool(cfg.get("attention_bias", False))
    window = cfg.get("sliding_window")
    fields.update(
        hidden_act=str(cfg.get("hidden_activation") or cfg.get("hidden_act") or "gelu_pytorch_tanh"),
        norm_kind=NormKind.GEMMA,
        sandwich_norm=True,
        embed_scale=float(fields["hidden_size"]) ** 0.5,
        attn_scale=float(cfg.get("query_pre_attn_scalar") or fields["head_dim"]) ** -0.5,
        attn_softcap=_float_or_none(cfg.get("attn_logit_softcapping")),
        final_softcap=_float_or_none(cfg.get("final_logit_softcapping")),
        tie_word_embeddings=bool(cfg.get("tie_word_embeddings", True)),
        qkv_bias=bias,
        o_bias=bias,
        sliding_window=None if window is None else int(window),
        layer_types=None if window is None else layer_types_of(cfg, pattern),
    )
    if cfg.get("use_bidirectional_attention"):
        raise ValueError(
            "use_bidirectional_attention is not supported (an encoder-style Gemma); pagedserve serves causal decoders"
        )
    return fields


def _float_or_none(value: Any) -> float | None:
    return None if value is None else float(value)


def parse_gemma2(cfg: Mapping[str, Any], arch: str) -> ModelSpec:
    return ModelSpec(**gemma_fields(cfg, arch, pattern=2))


GEMMA2 = Family(
    "gemma2",
    ("Gemma2ForCausalLM",),
    ("gemma2",),
    parse_gemma2,
    "causal_lm.Gemma2ForCausalLM",
    gguf_architectures=("gemma2",),
    tensor_parallel=True,
    notes="attention and final logit soft-capping, alternating sliding layers",
)
