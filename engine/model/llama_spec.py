"""What our Llama-family model reads from an HF config.json, checked once, plus RoPE frequencies.

Accepts both config layouts: transformers >= 5 (`rope_parameters` holding `rope_theta` and
`rope_type`) and older ones (top-level `rope_theta` and `rope_scaling`).
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    import torch

SUPPORTED_ARCHITECTURES = ("LlamaForCausalLM", "MistralForCausalLM", "Qwen2ForCausalLM")
_MODEL_TYPES = {"llama": "LlamaForCausalLM", "mistral": "MistralForCausalLM", "qwen2": "Qwen2ForCausalLM"}
SUPPORTED_ROPE_TYPES = ("default", "linear", "llama3")


def _as_dict(config: Any) -> dict[str, Any]:
    if isinstance(config, Mapping):
        return dict(config)
    if hasattr(config, "to_dict"):  # a transformers PretrainedConfig
        return config.to_dict()
    raise TypeError(f"expected a config mapping, got {type(config).__name__}")


def architecture_of(config: Mapping[str, Any]) -> str:
    """The one supported architecture named by `architectures` (or `model_type`), else ValueError."""
    names = list(config.get("architectures") or [])
    if not names and config.get("model_type") in _MODEL_TYPES:
        names = [_MODEL_TYPES[config["model_type"]]]
    if len(names) != 1 or names[0] not in SUPPORTED_ARCHITECTURES:
        found = ", ".join(names) or f"model_type {config.get('model_type')!r}"
        raise ValueError(f"unsupported architecture {found}; supported: {', '.join(SUPPORTED_ARCHITECTURES)}")
    return names[0]


@dataclass(frozen=True, slots=True)
class LlamaSpec:
    """Validated model hyper-parameters. `rope_scaling` is None for plain RoPE."""

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
    sliding_window: int | None  # None: full attention on every layer

    def __post_init__(self) -> None:
        if self.num_heads % self.num_kv_heads:
            raise ValueError(f"num_attention_heads {self.num_heads} not a multiple of kv heads {self.num_kv_heads}")
        if self.head_dim % 2:
            raise ValueError(f"head_dim must be even for RoPE, got {self.head_dim}")

    @classmethod
    def from_hf(cls, config: Any) -> LlamaSpec:
        """Parse an HF config (dict or PretrainedConfig); ValueError on anything we do not run."""
        cfg = _as_dict(config)
        arch = architecture_of(cfg)
        if cfg.get("hidden_act", "silu") != "silu":
            raise ValueError(f"unsupported hidden_act {cfg['hidden_act']!r}; only 'silu' is implemented")
        theta, scaling = _rope_params(cfg)
        num_heads = int(cfg["num_attention_heads"])
        head_dim = cfg.get("head_dim") or int(cfg["hidden_size"]) // num_heads
        attention_bias = bool(cfg.get("attention_bias", False))
        sliding = None
        qwen2_sliding = arch == "Qwen2ForCausalLM" and bool(
            cfg.get("use_sliding_window") or "sliding_attention" in (cfg.get("layer_types") or ())
        )
        if arch == "MistralForCausalLM" or qwen2_sliding:
            sliding = cfg.get("sliding_window")
        return cls(
            architecture=arch,
            vocab_size=int(cfg["vocab_size"]),
            hidden_size=int(cfg["hidden_size"]),
            intermediate_size=int(cfg["intermediate_size"]),
            num_layers=int(cfg["num_hidden_layers"]),
            num_heads=num_heads,
            num_kv_heads=int(cfg.get("num_key_value_heads") or num_heads),
            head_dim=int(head_dim),
            rms_norm_eps=float(cfg.get("rms_norm_eps", 1e-6)),
            max_position_embeddings=int(cfg.get("max_position_embeddings", 2048)),
            rope_theta=theta,
            rope_scaling=scaling,
            tie_word_embeddings=bool(cfg.get("tie_word_embeddings", False)),
            qkv_bias=arch == "Qwen2ForCausalLM" or attention_bias,
            o_bias=arch == "LlamaForCausalLM" and attention_bias,
            mlp_bias=arch == "LlamaForCausalLM" and bool(cfg.get("mlp_bias", False)),
            sliding_window=None if sliding is None else int(sliding),
        )


def _rope_params(cfg: Mapping[str, Any]) -> tuple[float, dict[str, Any] | None]:
    params = dict(cfg.get("rope_scaling") or {})
    params.update(cfg.get("rope_parameters") or {})
    theta = float(params.pop("rope_theta", None) or cfg.get("rope_theta") or 10000.0)
    if params.get("partial_rotary_factor", cfg.get("partial_rotary_factor", 1.0)) != 1.0:
        raise ValueError("partial_rotary_factor != 1 is not supported")
    rope_type = params.get("rope_type", params.get("type", "default"))
    if rope_type not in SUPPORTED_ROPE_TYPES:
        raise ValueError(f"unsupported rope type {rope_type!r}; supported: {', '.join(SUPPORTED_ROPE_TYPES)}")
    if rope_type == "default":
        return theta, None
    params["rope_type"] = rope_type
    if rope_type == "llama3":
        params.setdefault("original_max_position_embeddings", cfg.get("max_position_embeddings"))
    return theta, params


def rope_inv_freq(spec: LlamaSpec) -> torch.Tensor:
    """Inverse frequencies `[head_dim // 2]` float32, computed exactly as transformers does."""
    import torch  # only here: the spec itself is plain data the front end reads

    dim = spec.head_dim
    inv_freq = 1.0 / (spec.rope_theta ** (torch.arange(0, dim, 2, dtype=torch.int64).float() / dim))
    scaling = spec.rope_scaling
    if scaling is None:
        return inv_freq
    factor = float(scaling["factor"])
    if scaling["rope_type"] == "linear":
        return inv_freq / factor
    # llama3: keep high frequencies, divide low ones by `factor`, interpolate in between.
    low, high = float(scaling["low_freq_factor"]), float(scaling["high_freq_factor"])
    old_len = scaling["original_max_position_embeddings"]
    low_wavelen, high_wavelen = old_len / low, old_len / high
    wavelen = 2 * math.pi / inv_freq
    scaled = torch.where(wavelen > low_wavelen, inv_freq / factor, inv_freq)
    smooth = (old_len / wavelen - low) / (high - low)
    smoothed = (1 - smooth) * scaled / factor + smooth * scaled
    medium = ~(wavelen < high_wavelen) * ~(wavelen > low_wavelen)
    return torch.where(medium, smoothed, scaled)
