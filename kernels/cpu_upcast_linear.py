"""bfloat16 linear layers for CPUs without bf16 dot products: float32 GEMMs on weight chunks.

Where the CPU lacks avx512_bf16 / AMX, oneDNN emulates a bf16 GEMM and runs it ~4-5x slower than
the float32 GEMM of the same shape once a call has a few rows (`pagedserve.kernels.cpu_isa`). `UpcastLinear`
keeps the weight in bf16 (memory unchanged) and, for calls of `min_rows` rows or more, converts
it to float32 one chunk of output rows at a time (a chunk stays in cache) and multiplies in
float32 into the matching columns of the output, which is rounded to bf16 once. Products of two
bf16 values are exact in float32 and a bf16 GEMM accumulates in float32 too, so the results
match `F.linear` up to summation order. Calls of fewer rows (batch-1 decode: bound by reading
the weight, where converting it would double the bytes moved) run the native extension's
`bf16_linear_few_rows` (kernels/csrc/proj_gemv.h: each weight row read once, widened by a shift,
float32 FMAs), or
`F.linear` in bf16 where the extension cannot be built.

Measured per call, 2 threads, [rows, 576] x [576, 1536] in ms, bf16 `F.linear` -> this: 1 row
0.073 -> 0.131 (hence `min_rows`), 4 rows 0.35 -> 0.15, 64 rows 2.8 -> 0.71, 1,000 rows 32 -> 6.7;
the 49152-row LM head at 64 rows 69 -> 24 (benchmarks/bench_packed_linear.py).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from pagedserve.kernels.cpu_native import load_native

UPCAST_MIN_ROWS = 4  # fewer rows: bf16 F.linear (the weight read dominates)
CHUNK_ROWS = 512
GEMV_MAX_ROWS = 8  # the C++ kernel's limit  # output rows converted at a time: 512 x 1536 float32 = 3 MiB


def load_gemv():
    """The native extension (pagedserve.kernels.cpu_native), which has the few-rows kernel; None if unavailable."""
    return load_native()


def upcast_linear(
    x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, chunk_rows: int = CHUNK_ROWS
) -> torch.Tensor:
    """`F.linear(x, weight, bias)` for 2-D `x`, computed in float32 chunk by chunk of `weight`'s
    rows, returned in `x`'s dtype."""
    xf = x.float()
    out_features = weight.shape[0]
    out = torch.empty(x.shape[0], out_features, dtype=torch.float32, device=x.device)
    buf = torch.empty(min(chunk_rows, out_features), weight.shape[1], dtype=torch.float32, device=x.device)
    for start in range(0, out_features, chunk_rows):
        end = min(start + chunk_rows, out_features)
        chunk = buf[: end - start]
        chunk.copy_(weight[start:end])
        torch.mm(xf, chunk.t(), out=out[:, start:end])
    if bias is not None:
        out += bias
    return out.to(x.dtype)


class UpcastLinear(nn.Module):
    """`y = x @ weight.T + bias` for bf16 `x [..., in]` and a bf16 `weight [out, in]`; `gemv` is
    the loaded `bf16_gemv` extension (`load_gemv()`) for calls of fewer than `min_rows` rows, or
    None for `F.linear` there."""

    def __init__(
        self, weight: torch.Tensor, bias: torch.Tensor | None, min_rows: int = UPCAST_MIN_ROWS, gemv=None
    ) -> None:
        super().__init__()
        if weight.dtype != torch.bfloat16 or weight.device.type != "cpu" or weight.dim() != 2:
            raise ValueError("UpcastLinear takes a 2-D bfloat16 CPU weight")
        self.in_features = weight.shape[1]
        self.out_features = weight.shape[0]
        if gemv is not None and min_rows - 1 > GEMV_MAX_ROWS:
            raise ValueError(f"the few-rows kernel takes at most {GEMV_MAX_ROWS} rows (min_rows={min_rows})")
        self.min_rows = min_rows
        self.gemv = gemv
        self.weight = weight.detach().contiguous()
        self.bias = None if bias is None else bias.detach().contiguous()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.shape[-1] != self.in_features:
            raise ValueError(f"expected {self.in_features} input features, got {x.shape[-1]}")
        rows = x.reshape(-1, self.in_features)
        if rows.shape[0] < self.min_rows:
            if self.gemv is None:
                out = F.linear(rows, self.weight, self.bias)
            else:
                out = self.gemv.bf16_linear_few_rows(rows.contiguous(), self.weight, self.bias)
        else:
            out = upcast_linear(rows, self.weight, self.bias)
        return out.view(*x.shape[:-1], self.out_features)
