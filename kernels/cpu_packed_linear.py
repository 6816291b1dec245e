"""bfloat16 linear layers on CPU with the weight packed once into oneDNN's blocked layout.

`F.linear` on a plain bf16 CPU weight lets oneDNN reorder the weight on every call; at decode
batch sizes that reorder is a large share of the matmul (the 49152-row LM head at 64 rows ran
1.7-2.7x faster packed; the MLP projections ~1.1x; prefill-sized calls about the same:
benchmarks/bench_packed_linear.py). Packing at load time removes it. The packed
tensor replaces the plain weight, so memory does not grow. The reference is `F.linear`.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

# oneDNN picks the blocked layout for an expected row count; any row count works with it.
_BATCH_HINT = 64


def packed_linear_supported() -> bool:
    """True where this torch has the oneDNN ops and they reproduce F.linear on a tiny case."""
    ops = getattr(torch.ops, "mkldnn", None)
    if not torch.backends.mkldnn.is_available() or ops is None:
        return False
    try:
        gen = torch.Generator().manual_seed(0)
        x = torch.randn(3, 32, generator=gen).bfloat16()
        w = torch.randn(16, 32, generator=gen).bfloat16()
        got = PackedLinear(w, None)(x)
    except (RuntimeError, AttributeError):
        return False
    return torch.allclose(got.float(), F.linear(x, w).float(), rtol=1e-2, atol=1e-2)


class PackedLinear(nn.Module):
    """`y = x @ weight.T + bias` for bf16 `x [..., in]`, with `weight [out, in]` packed."""

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None) -> None:
        super().__init__()
        if weight.dtype != torch.bfloat16 or weight.device.type != "cpu" or weight.dim() != 2:
            raise ValueError("PackedLinear takes a 2-D bfloat16 CPU weight")
        self.in_features = weight.shape[1]
        self.out_features = weight.shape[0]
        self.packed_weight = torch.ops.mkldnn._reorder_linear_weight(weight.detach().contiguous(), _BATCH_HINT)
        self.bias = None if bias is None else bias.detach().contiguous()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.shape[-1] != self.in_features:
            raise ValueError(f"expected {self.in_features} input features, got {x.shape[-1]}")
        rows = x.reshape(-1, self.in_features).contiguous()
        out = torch.ops.mkldnn._linear_pointwise(rows, self.packed_weight, self.bias, "none", [], "")
        return out.view(*x.shape[:-1], self.out_features)


class SharedWeightLinear(nn.Module):
    """`y = x @ weight.T` over a bf16 weight another module owns (a tied LM head over the
    embedding table), never copied: packing it would keep a second copy of the whole table
    (+335 MB for Gemma 3's 262k vocabulary) beside the plain one the lookups read. A single row
    runs the native few-rows kernel (`gemv`), more rows `F.linear` (oneDNN reorders the weight
    per call). Measured on a quiet Xeon with AMX, 2 threads, ms per call (packed / this):
    Gemma 3's [262144, 640] head 19.6 / 18.6 at 1 row, 19.5 / 28.1 at 8, 26.5 / 32.1 at 32;
    the 1.1B Qwen3's [151936, 2048] head 34.3 / 41.6 at 1 row (F.linear: 37.6), 34.6 / 39.0 at 8,
    46.5 / 45.2 at 32. The kernel wins at one row on the narrow Gemma head and loses ~10 % on
    the wide one; from 2-4 rows on F.linear is faster on both, hence `few_rows` 1."""

    def __init__(self, weight: torch.Tensor, gemv=None, few_rows: int = 1) -> None:
        super().__init__()
        if weight.dtype != torch.bfloat16 or weight.device.type != "cpu" or weight.dim() != 2:
            raise ValueError("SharedWeightLinear takes a 2-D bfloat16 CPU weight")
        self.weight = weight.detach()  # a view of the owner's tensor (same storage, not a parameter)
        self.in_features, self.out_features = weight.shape[1], weight.shape[0]
        self.gemv, self.few_rows = gemv, few_rows

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.shape[-1] != self.in_features:
            raise ValueError(f"expected {self.in_features} input features, got {x.shape[-1]}")
        rows = x.reshape(-1, self.in_features)
        if self.gemv is not None and rows.shape[0] <= self.few_rows:
            out = self.gemv.bf16_linear_few_rows(rows.contiguous(), self.weight, None)
        else:
            out = F.linear(rows, self.weight)
        return out.view(*x.shape[:-1], self.out_features)
