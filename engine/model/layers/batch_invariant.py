"""Batch-invariant linear layers, and the switch that makes a loaded model batch-invariant.

oneDNN and MKL choose a GEMM's blocking, kernel and thread split from its shape: on this
project's CPUs a bf16 `F.linear` gave a row different bits when the call had 9-32 rows than when
it had 1-8 or 33-999 (2 threads), and other ranges with 1 thread. A token's projections then
depend on how many other tokens share its step: batch size, chunked prefill and prefix-cache
hits all change the rounding. `BatchInvariantLinear` calls the GEMM only on tiles of exactly
`ROW_TILE` rows (the last tile padded with zeros), so every call has one shape and one kernel
configuration, whose reduction over the input features is the same for every row of the tile
(tests/engine/attention/test_batch_invariant.py checks a row against itself at every offset of a tile and
alone); the rows of a step are then cut into tiles, and no row's result depends on the others.

The rest of the model needs nothing: RMSNorm (the fused C++ op and torch's last-dim reduction
both reduce each row alone, serially), RoPE, SiLU and the residual adds are per row or per
element; attention is the backend's (`pagedserve.engine.attention.batch_invariant`).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, Protocol

import torch
import torch.nn.functional as F
from torch import nn

from pagedserve.kernels.cpu_packed_linear import packed_linear_supported

# Rows of every GEMM call. Larger tiles make prefill cheaper and small-batch decode dearer (a
# decode step pays a whole tile per projection). SmolLM2's four projections of one layer, bf16,
# 1 thread, Xeon with AMX, ms (oneDNN packed / tiles of 16, 32, 64, 128 rows): 1 row 0.49 / 0.51,
# 0.73, 0.90, 1.23; 64 rows 0.63 / 1.99, 1.43, 0.88, 1.29; 512 rows 8.4 / 56, 41, 19, 12.
# The whole model's cost: benchmarks/batch_invariant.py.
ROW_TILE = 64


class BatchInvariantLinear(nn.Module):
    """`y = x @ weight.T + bias` computed tile by tile of `tile` rows (see the module docstring);
    a bf16 CPU weight is packed once in oneDNN's layout for that tile."""

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None, tile: int = ROW_TILE) -> None:
        super().__init__()
        if weight.dim() != 2:
            raise ValueError("BatchInvariantLinear takes a 2-D weight")
        self.in_features, self.out_features = weight.shape[1], weight.shape[0]
        self.tile = tile
        self.bias = None if bias is None else bias.detach().contiguous()
        self.packed = weight.dtype == torch.bfloat16 and weight.device.type == "cpu" and packed_linear_supported()
        weight = weight.detach().contiguous()
        self.weight = torch.ops.mkldnn._reorder_linear_weight(weight, tile) if self.packed else weight

    def _gemm(self, rows: torch.Tensor) -> torch.Tensor:
        if self.packed:
            return torch.ops.mkldnn._linear_pointwise(rows, self.weight, self.bias, "none", [], "")
        return F.linear(rows, self.weight, self.bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.shape[-1] != self.in_features:
            raise ValueError(f"expected {self.in_features} input features, got {x.shape[-1]}")
        rows = x.reshape(-1, self.in_features)
        num_rows, tile = rows.shape[0], self.tile
        padded = -(-num_rows // tile) * tile
        if padded != num_rows or not rows.is_contiguous():
            full = rows.new_zeros(padded, self.in_features)
            full[:num_rows] = rows
            rows = full
        if padded == tile:
            out = self._gemm(rows)[:num_rows]
        else:
            out = torch.cat([self._gemm(rows[i : i + tile]) for i in range(0, padded, tile)])[:num_rows]
        return out.view(*x.shape[:-1], self.out_features)


class _Model(Protocol):
    """What `make_batch_invariant` reads of a `CausalLM` (pagedserve.engine.model.causal_lm, above this module)."""

    spec: Any

    def _projections(self) -> list[tuple[str, nn.Module, str]]: ...

    def pack_linear_weights(self, make: Callable[[torch.Tensor, torch.Tensor | None], nn.Module]) -> None: ...


def make_batch_invariant(model: _Model) -> None:
    """Swap every projection and the LM head of a loaded `CausalLM` for `BatchInvariantLinear`.
    Raises ValueError for what the mode does not cover: quantized layers and mixture-of-experts
    models (their routers group tokens by expert, so a token's experts run in batch-shaped GEMMs)."""
    if getattr(model.spec, "moe", None) is not None:
        raise ValueError("batch_invariant: mixture-of-experts models are not supported")
    for _, parent, name in model._projections():
        if type(getattr(parent, name)) is not nn.Linear:
            raise ValueError("batch_invariant: quantized layers are not supported")
    model.pack_linear_weights(BatchInvariantLinear)
