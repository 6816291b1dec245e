"""Rotary position embeddings: inverse frequencies as transformers computes them, and the cos/sin
tables a model precomputes once for every position it can see.

A model may hold two tables: the "global" one of its full-attention layers (with the config's
scaling) and a "local" one for sliding layers with their own base (Gemma 3's
`rope_local_base_freq`, plain RoPE). LongRoPE (Phi-3) uses its short factors for positions below
`original_max_position_embeddings` and its long ones from there on, as vLLM does (transformers
switches every position to the long factors once a sequence grows past that length).
"""

from __future__ import annotations

import math
from typing import Any

import torch

from pagedserve.engine.model.spec import ModelSpec

GLOBAL, LOCAL = "global", "local"


def _base_inv_freq(theta: float, dim: int) -> torch.Tensor:
    return 1.0 / (theta ** (torch.arange(0, dim, 2, dtype=torch.int64).float() / dim))


def rope_inv_freq(spec: ModelSpec) -> torch.Tensor:
    """Inverse frequencies `[head_dim // 2]` float32 of the full-attention layers (LongRoPE: the
    short factors), computed exactly as transformers does."""
    return _scaled_inv_freq(spec.rope_theta, spec.head_dim, spec.rope_scaling, long=False)


def _scaled_inv_freq(theta: float, dim: int, scaling: dict[str, Any] | None, long: bool) -> torch.Tensor:
    if scaling is None:
        return _base_inv_freq(theta, dim)
    kind = scaling["rope_type"]
    if kind == "longrope":
        factors = torch.tensor(scaling["long_factor" if long else "short_factor"], dtype=torch.float32)
        return 1.0 / (factors * theta ** (torch.arange(0, dim, 2, dtype=torch.int64).float() / dim))
    inv_freq = _base_inv_freq(theta, dim)
    factor = float(scaling["factor"])
    if kind == "linear":
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


def _attention_factor(spec: ModelSpec) -> float:
    """LongRoPE's cos/sin multiplier (1 for every other type)."""
    scaling = spec.rope_scaling
    if scaling is None or scaling["rope_type"] != "longrope":
        return 1.0
    if scaling.get("attention_factor") is not None:
        return float(scaling["attention_factor"])
    original = scaling["original_max_position_embeddings"]
    factor = scaling.get("factor") or spec.max_position_embeddings / original
    return 1.0 if factor <= 1.0 else math.sqrt(1 + math.log(factor) / math.log(original))


def rope_tables(
    spec: ModelSpec, max_len: int, dtype: torch.dtype, device: torch.device
) -> dict[str, tuple[torch.Tensor, torch.Tensor]]:
    """{table name: (cos, sin)}, each `[max_len, head_dim // 2]` in `dtype` (computed in float32
    and cast, like transformers' cast before use). LOCAL only when sliding layers have their own base."""
    positions = torch.arange(max_len, dtype=torch.float32)[:, None]
    freqs = positions * rope_inv_freq(spec)
    scaling = spec.rope_scaling
    if scaling is not None and scaling["rope_type"] == "longrope":
        original = int(scaling["original_max_position_embeddings"])
        long = positions * _scaled_inv_freq(spec.rope_theta, spec.head_dim, scaling, long=True)
        freqs = torch.where(positions < original, freqs, long)
    factor = _attention_factor(spec)
    tables = {GLOBAL: _cos_sin(freqs, factor, dtype, device)}
    if spec.local_rope_theta is not None:
        local = positions * _base_inv_freq(spec.local_rope_theta, spec.head_dim)
        tables[LOCAL] = _cos_sin(local, 1.0, dtype, device)
    return tables


def _cos_sin(
    freqs: torch.Tensor, factor: float, dtype: torch.dtype, device: torch.device
) -> tuple[torch.Tensor, torch.Tensor]:
    cos, sin = freqs.cos(), freqs.sin()
    if factor != 1.0:
        cos, sin = cos * factor, sin * factor
    return cos.to(dtype=dtype, device=device), sin.to(dtype=dtype, device=device)


def table_of(spec: ModelSpec, layer: int) -> str:
    """Which table layer `layer` rotates with."""
    return LOCAL if spec.local_rope_theta is not None and spec.window_of(layer) is not None else GLOBAL


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate-half RoPE of `x [T, heads, head_dim]` with `cos`/`sin [T, 1, head_dim // 2]`."""
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1)
