"""The gated MLP shared by every dense family: `down(act(gate(x)) * up(x))`, gate and up as one
fused linear (`gate_up_proj`, rows gate|up). The activation is the spec's: SiLU (with the fused
C++ op when present) or GELU with the tanh approximation (Gemma)."""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import nn

from pagedserve.engine.lora.punica import LoRALayer
from pagedserve.engine.model.layers.norm import eager_ops
from pagedserve.engine.model.spec import ModelSpec
from pagedserve.kernels.cpu_fused_ops import CpuFusedOps


class GatedMLP(nn.Module):
    def __init__(
        self, spec: ModelSpec, dtype: torch.dtype, ops: CpuFusedOps | None = None, intermediate_size: int | None = None
    ) -> None:
        super().__init__()
        size = intermediate_size or spec.intermediate_size
        self.gate_up_proj = nn.Linear(spec.hidden_size, 2 * size, bias=spec.mlp_bias, dtype=dtype)
        self.down_proj = nn.Linear(size, spec.hidden_size, bias=spec.mlp_bias, dtype=dtype)
        self.gelu = spec.hidden_act == "gelu_pytorch_tanh"
        self.ops = ops
        # Tensor parallelism (pagedserve.engine.model.layers.parallel): sums the ranks' partial down_proj outputs.
        self.reduce: Callable[[torch.Tensor], torch.Tensor] | None = None

    def forward(self, h: torch.Tensor, lora: LoRALayer | None = None) -> torch.Tensor:
        gate_up = self.gate_up_proj(h)
        if lora is not None:
            lora.add("gate_up", h, gate_up)
        act = self.act(gate_up)
        out = self.down_proj(act) if lora is None else lora.add("down", act, self.down_proj(act))
        return out if self.reduce is None else self.reduce(out)

    def act(self, gate_up: torch.Tensor) -> torch.Tensor:
        """`act(gate) * up` of the fused `[..., 2 * size]` projection."""
        ops = eager_ops(self.ops)
        if ops and not self.gelu:
            return ops.silu_and_mul(gate_up)
        gate, up = gate_up.chunk(2, dim=-1)
        return (F.gelu(gate, approximate="tanh") if self.gelu else F.silu(gate)) * up
