"""Fused elementwise ops of the Llama decoder for CPU (C++ extension), with plain-torch references.

The references are exactly the torch code of `pagedserve.engine.model.layers`; the kernels reproduce their
rounding (per-op bf16 rounding, torch's float32 sum order for the RMSNorm mean, Sleef's exp for
SiLU), so the fused path gives bit-identical results. `load_fused_ops()` returns a `CpuFusedOps`
or None where the extension cannot be built.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from pagedserve.kernels.cpu_native import load_native

_DTYPES = (torch.float32, torch.bfloat16)


def load_fused_ops() -> CpuFusedOps | None:
    """Compile (first call on a machine) or load the extension; None if unavailable."""
    ext = load_native()
    return None if ext is None else CpuFusedOps(ext)


class CpuFusedOps:
    """Launchers: check shapes and dtypes, flatten leading dims, then run the extension's kernel."""

    def __init__(self, ext) -> None:
        self._ext = ext
        # The kernels replay torch's vector widths: its float32 sum runs the AVX2 kernel (8-float
        # vectors) even on AVX512 machines, SiLU the kernel of the CPU capability.
        capability = torch.backends.cpu.get_cpu_capability()
        self._sum_width = 8
        self._silu_vec_bytes = {"AVX512": 64, "AVX2": 32}.get(capability, 0)

    def rms_norm(self, x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
        """HF RMSNorm of `x [..., n]` (float32 math, cast to dtype, times `weight [n]`)."""
        _check(x, weight)
        out = self._ext.rms_norm(x.reshape(-1, x.shape[-1]).contiguous(), weight, float(eps), self._sum_width)
        return out.view(x.shape)

    def fused_add_rms_norm(
        self, x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float
    ) -> torch.Tensor:
        """`residual += x` in place (in the dtype), then returns `rms_norm(residual)`."""
        _check(x, weight)
        if residual.shape != x.shape or residual.dtype != x.dtype or not residual.is_contiguous():
            raise ValueError("residual must be contiguous and match x in shape and dtype")
        flat = (-1, x.shape[-1])
        out = self._ext.fused_add_rms_norm(
            x.reshape(flat).contiguous(), residual.view(flat), weight, float(eps), self._sum_width
        )
        return out.view(x.shape)

    def silu_and_mul(self, gate_up: torch.Tensor) -> torch.Tensor:
        """`silu(gate) * up` for `gate_up = [gate | up]` on the last dim; returns `[..., n]`."""
        if gate_up.device.type != "cpu" or gate_up.dtype not in _DTYPES or gate_up.shape[-1] % 2:
            raise ValueError(
                f"expected a CPU float32/bfloat16 [..., 2n] tensor, got {gate_up.dtype} {tuple(gate_up.shape)}"
            )
        out = self._ext.silu_and_mul(gate_up.reshape(-1, gate_up.shape[-1]).contiguous(), self._silu_vec_bytes)
        return out.view(*gate_up.shape[:-1], gate_up.shape[-1] // 2)

    def rotary_embedding_(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        """Rotate-half RoPE of `x [T, heads, head_dim]` in place; `cos`/`sin [T, 1, head_dim // 2]`."""
        if x.device.type != "cpu" or x.dtype not in _DTYPES or x.dim() != 3:
            raise ValueError(f"expected a CPU float32/bfloat16 [T, heads, head_dim] tensor, got {x.dtype}")
        if x.stride(2) != 1 or x.stride(1) != x.shape[2]:
            raise ValueError("x must have contiguous heads and head_dim (any token stride)")
        half = (x.shape[0], x.shape[2] // 2)
        if cos.dtype != x.dtype or sin.dtype != x.dtype or cos.numel() != half[0] * half[1] or sin.shape != cos.shape:
            raise ValueError(f"cos/sin must be {x.dtype} [T, 1, {half[1]}]")
        self._ext.rotary_embedding_(x, cos.reshape(half).contiguous(), sin.reshape(half).contiguous())
        return x


def _check(x: torch.Tensor, weight: torch.Tensor) -> None:
    if x.device.type != "cpu" or x.dtype not in _DTYPES:
        raise ValueError(f"expected a CPU float32/bfloat16 tensor, got {x.device} {x.dtype}")
    if weight.dtype != x.dtype or weight.shape != (x.shape[-1],) or not weight.is_contiguous():
        raise ValueError(f"weight must be contiguous {x.dtype} [{x.shape[-1]}]")


# -- plain-torch references: exactly the code of pagedserve.engine.model.layers -----------------------------
def reference_rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    h = x.float()
    h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + eps)
    return weight * h.to(x.dtype)


def reference_fused_add_rms_norm(
    x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """Returns (normed, new residual); the input residual is not modified."""
    residual = residual + x
    return reference_rms_norm(residual, weight, eps), residual


def reference_silu_and_mul(gate_up: torch.Tensor) -> torch.Tensor:
    gate, up = gate_up.chunk(2, dim=-1)
    return F.silu(gate) * up


def reference_rotary_embedding(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1)
