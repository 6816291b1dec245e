"""What a decoder-only model reads from an HF config.json, checked once: `ModelSpec`.

One spec type serves every family (`pagedserve.engine.model.registry.parse_config` parses an HF config): the fields common to all decoders,
plus the few knobs where families differ (activation, q/k norms, Gemma's norms and scales,
soft-capping, sliding-window layers, a local RoPE base). Each family's file parses its config
into a spec with `base_fields` and its own differences; the shared layers read the knobs.

Accepts both config layouts: transformers >= 5 (`rope_parameters` holding `rope_theta` and
`rope_type`, per layer kind for Gemma 3) and older ones (top-level `rope_theta`, `rope_scaling`).
"""

from __future__ import annotations

import enum
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

SUPPORTED_ROPE_TYPES = ("default", "linear", "llama3", "longrope")
SUPPORTED_ACTIVATIONS = ("silu", "gelu_pytorch_tanh")


class NormKind(enum.Enum):
    """How an RMSNorm applies its weight: Llama's `w * norm(x).to(dtype)`, or Gemma's
    `(norm(x) * (1 + w)).to(dtype)` computed in float32."""

    LLAMA = "llama"
    GEMMA = "gemma"


def as_dict(config: Any) -> dict[str, Any]:
    if isinstance(config, Mapping):
        return dict(config)
    if hasattr(config, "to_dict"):  # a transformers PretrainedConfig
        return config.to_dict()
    raise TypeError(f"expected a config mapping, got {type(config).__name__}")


class RouterScoring(enum.Enum):
    """How router logits become the top-k experts' weights."""

    SOFTMAX_TOPK = "softmax_topk"  # softmax over all experts, then the k largest (Qwen2/3-MoE, OLMoE)
    TOPK_SOFTMAX = "topk_softmax"  # the k largest logits, then softmax over those k (Mixtral)


@dataclass(frozen=True, slots=True)
class MoESpec:
    """One sparse block's sizes and routing. `normalize`: rescale the top-k weights of
    SOFTMAX_TOPK to sum to 1 (`norm_topk_prob`); TOPK_SOFTMAX weights always sum to 1.
    `shared_intermediate_size` 0: no shared expert; `shared_gate`: the shared expert's output is
    scaled by a sigmoid gate (Qwen2-MoE). `dense_layers`: the layers that keep a dense MLP of
    the model's `intermediate_size` instead (Qwen's `mlp_only_layers` / `decoder_sparse_step`)."""

    num_experts: int
    top_k: int
    intermediate_size: int
    scoring: RouterScoring
    normalize: bool
    shared_intermediate_size: int = 0
    shared_gate: bool = False
    dense_layers: tuple[int, ...] = ()

    def __post_init__(self) -> None:
        if self.num_experts < 1 or not 1 <= self.top_k <= self.num_experts:
            raise ValueError(f"num_experts_per_tok {self.top_k} must be between 1 and the {self.num_experts} experts")
        if self.intermediate_size < 1 or self.shared_intermediate_size < 0:
            raise ValueError(
                f"expert intermediate sizes must be positive, got {self.intermediate_size} "
                f"and {self.shared_intermediate_size}"
            )
        if self.shared_gate and not self.shared_intermediate_size:
            raise ValueError("a shared expert gate needs a shared expert")


@dataclass(frozen=True, slots=True)
class ModelSpec:
    """Validated model hyper-parameters. `rope_scaling` is None for plain RoPE.

    `layer_types[i]` is "full_attention" or "sliding_attention" (None: every layer full);
    a sliding layer attends to its last `sliding_window` tokens (itself included).
    """

    architecture: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float
    max_position_embeddings: int
    rope_theta: float
    rope_scaling: dict[str, Any] | None
    tie_word_embeddings: bool
    qkv_bias: bool
    o_bias: bool
    mlp_bias: bool
    sliding_window: int | None  # the sliding layers' window; None: full attention on every layer
    layer_types: tuple[str, ...] | None = None
    hidden_act: str = "silu"
    norm_kind: NormKind = NormKind.LLAMA
    qk_norm: bool = False  # an RMSNorm over each query and key head before RoPE (Qwen3, Gemma 3)
    sandwich_norm: bool = False  # norms after attention and around the MLP too (Gemma 2 / 3)
    embed_scale: float | None = None  # embeddings times this (cast to the model dtype first)
    attn_scale: float | None = None  # None: head_dim ** -0.5
    attn_softcap: float | None = None  # scores -> cap * tanh(scores / cap)
    final_softcap: float | None = None  # logits -> cap * tanh(logits / cap)
    local_rope_theta: float | None = None  # sliding layers' RoPE base (plain RoPE), Gemma 3
    qk_norm_full: bool = False  # with qk_norm: one norm over all query heads and one over all KV heads (OLMoE)
    moe: MoESpec | None = None  # mixture-of-experts MLPs (pagedserve.engine.model.layers.moe); None: dense

    def __post_init__(self) -> None:
        if self.num_heads % self.num_kv_heads:
            raise ValueError(f"num_attention_heads {self.num_heads} not a multiple of kv heads {self.num_kv_heads}")
        if self.head_dim % 2:
            raise ValueError(f"head_dim must be even for RoPE, got {self.head_dim}")
        if self.hidden_act not in SUPPORTED_ACTIVATIONS:
            raise ValueError(
                f"unsupported hidden_act {self.hidden_act!r}; supported: {', '.join(SUPPORTED_ACTIVATIONS)}"
            )
        if self.layer_types is not None:
            if len(self.layer_types) != self.num_layers:
                raise ValueError(f"layer_types has {len(self.layer_types)} entries for {self.num_layers} layers")
            unknown = set(self.layer_types) - {"full_attention", "sliding_attention"}
            if unknown:
                raise ValueError(
                    f"unsupported layer types {sorted(unknown)}; supported: full_attention, sliding_attention"
                )
            if "sliding_attention" in self.layer_types and not self.sliding_window:
                raise ValueError("sliding_attention layers need a sliding_window")

    def window_of(self, layer: int) -> int | None:
        """The sliding window of `layer` in tokens, None for full attention."""
        if self.sliding_window is None:
            return None
        if self.layer_types is None or self.layer_types[layer] == "sliding_attention":
            return self.sliding_window
        return None

    @property
    def scale(self) -> float:
        return self.attn_scale if self.attn_scale is not None else self.head_dim**-0.5

    @property
    def needs_plain_attention(self) -> bool:
        """Windows or soft-capping: attention the compiled op does not express."""
        return self.sliding_window is not None or self.attn_softcap is not None


def base_fields(cfg: Mapping[str, Any], architecture: str) -> dict[str, Any]:
    """The fields every decoder config spells the same way; a family adds its differences."""
    num_heads = int(cfg["num_attention_heads"])
    theta, scaling = rope_params(cfg)
    return dict(
        architecture=architecture,
        vocab_size=int(cfg["vocab_size"]),
        hidden_size=int(cfg["hidden_size"]),
        intermediate_size=int(cfg["intermediate_size"]),
        num_layers=int(cfg["num_hidden_layers"]),
        num_heads=num_heads,
        num_kv_heads=int(cfg.get("num_key_value_heads") or num_heads),
        head_dim=int(cfg.get("head_dim") or int(cfg["hidden_size"]) // num_heads),
        rms_norm_eps=float(cfg.get("rms_norm_eps", 1e-6)),
        max_position_embeddings=int(cfg.get("max_position_embeddings", 2048)),
        rope_theta=theta,
        rope_scaling=scaling,
        tie_word_embeddings=bool(cfg.get("tie_word_embeddings", False)),
        qkv_bias=bool(cfg.get("attention_bias", False)),
        o_bias=False,
        mlp_bias=False,
        sliding_window=None,
        hidden_act=str(cfg.get("hidden_act") or cfg.get("hidden_activation") or "silu"),
    )


def layer_types_of(cfg: Mapping[str, Any], pattern: int | None = None) -> tuple[str, ...] | None:
    """The config's `layer_types`, or (older configs) every `pattern`-th layer full, the rest
    sliding (Gemma 2: 2, Gemma 3: `sliding_window_pattern`, 6 by default); None without either."""
    types = cfg.get("layer_types")
    if types:
        return tuple(types)
    if pattern is None:
        return None
    return tuple(
        "sliding_attention" if (i + 1) % pattern else "full_attention" for i in range(int(cfg["num_hidden_layers"]))
    )


def rope_params(cfg: Mapping[str, Any], kind: str = "full_attention") -> tuple[float, dict[str, Any] | None]:
    """(theta, scaling parameters or None) of the RoPE of `kind` layers; ValueError naming an
    unsupported rope type. Nested `rope_parameters` (per layer kind) are read for `kind`."""
    nested = cfg.get("rope_parameters") or {}
    if kind in nested or "full_attention" in nested:
        nested = nested.get(kind) or {}
    params = dict(cfg.get("rope_scaling") or {}) if kind == "full_attention" else {}
    params.update(nested)
    theta = float(params.pop("rope_theta", None) or cfg.get("rope_theta") or 10000.0)
    if params.get("partial_rotary_factor", cfg.get("partial_rotary_factor", 1.0)) != 1.0:
        raise ValueError("partial_rotary_factor != 1 is not supported")
    rope_type = params.get("rope_type", params.get("type", "default"))
    if rope_type not in SUPPORTED_ROPE_TYPES:
        raise ValueError(f"unsupported rope type {rope_type!r}; supported: {', '.join(SUPPORTED_ROPE_TYPES)}")
    if rope_type == "default":
        return theta, None
    params["rope_type"] = rope_type
    if rope_type in ("llama3", "longrope"):
        params.setdefault(
            "original_max_position_embeddings",
            cfg.get("original_max_position_embeddings") or cfg.get("max_position_embeddings"),
        )
    return theta, params


def num_experts(cfg: Mapping[str, Any]) -> int:
    """The expert count, spelled `num_experts` (Qwen, OLMoE checkpoints) or `num_local_experts`
    (Mixtral, and transformers 5's own Qwen3-MoE config)."""
    value = cfg.get("num_experts", cfg.get("num_local_experts"))
    if value is None:
        raise ValueError(f"config.json of {cfg.get('architectures')} names no num_experts")
    return int(value)


def qwen_dense_layers(cfg: Mapping[str, Any]) -> tuple[int, ...]:
    """Qwen2/3-MoE: layers in `mlp_only_layers`, and those off the `decoder_sparse_step` grid,
    keep a dense MLP (as transformers builds them)."""
    only = set(cfg.get("mlp_only_layers") or ())
    step = int(cfg.get("decoder_sparse_step") or 1)
    return tuple(
        i for i in range(int(cfg["num_hidden_layers"])) if i in only or num_experts(cfg) <= 0 or (i + 1) % step
    )
