"""RMS norms, with the residual add fused in: Llama's and Gemma's rounding.

`forward(x)` returns the norm; `forward(x, residual)` first adds `x` to the residual stream and
returns `(norm(residual + x), residual + x)`. As in vLLM, the residual stream travels beside the
hidden states between layers, so each residual add fuses with the norm after it.
"""

from __future__ import annotations

import torch
from torch import nn

from pagedserve.engine.model.spec import ModelSpec, NormKind
from pagedserve.kernels.cpu_fused_ops import CpuFusedOps


def eager_ops(ops: CpuFusedOps | None) -> CpuFusedOps | None:
    """The fused ops, or None while torch.compile traces (inductor fuses the torch glue itself;
    the extension's calls cannot be traced)."""
    return None if ops is None or torch.compiler.is_compiling() else ops


class RMSNorm(nn.Module):
    """HF LlamaRMSNorm: normalise in float32, cast back, then scale by the weight. With the
    fused ops (pagedserve.kernels.cpu_fused_ops) the add + norm is one C++ op that rounds the same way (it
    updates `residual` in place)."""

    def __init__(self, size: int, eps: float, dtype: torch.dtype, ops: CpuFusedOps | None = None) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.empty(size, dtype=dtype))
        self.eps = eps
        self.ops = ops

    def forward(
        self, x: torch.Tensor, residual: torch.Tensor | None = None
    ) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
        ops = eager_ops(self.ops)
        if residual is None:
            return ops.rms_norm(x, self.weight, self.eps) if ops else self._norm(x)
        if ops:
            return ops.fused_add_rms_norm(x, residual, self.weight, self.eps), residual
        residual = residual + x
        return self._norm(residual), residual

    def _norm(self, x: torch.Tensor) -> torch.Tensor:
        h = x.float()
        h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * h.to(x.dtype)


class GemmaRMSNorm(nn.Module):
    """HF Gemma's RMSNorm: `(norm(x) * (1 + w)).to(dtype)`, all in float32. The checkpoint's
    weight is stored as is (zero means identity) and kept in float32: `1 + w` rounded to bf16
    would lose most of `w`."""

    def __init__(self, size: int, eps: float, dtype: torch.dtype, ops: CpuFusedOps | None = None) -> None:
        super().__init__()
        del dtype, ops  # float32 weight; no fused op rounds this way
        self.weight = nn.Parameter(torch.empty(size, dtype=torch.float32))
        self.eps = eps

    def forward(
        self, x: torch.Tensor, residual: torch.Tensor | None = None
    ) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
        if residual is None:
            return self._norm(x)
        residual = residual + x
        return self._norm(residual), residual

    def _norm(self, x: torch.Tensor) -> torch.Tensor:
        h = x.float()
        h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + self.eps)
        return (h * (1.0 + self.weight)).to(x.dtype)


def make_norm(spec: ModelSpec, size: int, dtype: torch.dtype, ops: CpuFusedOps | None = None) -> nn.Module:
    """The family's RMSNorm of `size` features."""
    cls = GemmaRMSNorm if spec.norm_kind is NormKind.GEMMA else RMSNorm
    return cls(size, spec.rms_norm_eps, dtype, ops)
