"""De-quantize int4 weights (torch's CPU int4 packed layout) to a float32 `W^T [K, N]` in one
pass (C++, kernels/csrc/int4_dequant.cpp), for calls with enough rows that one float32 GEMM
beats the weight-only int4 kernel. `load_int4_dequant()` returns None where the extension cannot
be built; `reference_int4pack_dequant_t` is the plain-torch reference.
"""

from __future__ import annotations

from pathlib import Path

import torch

from kernels.cpu_build import CpuExtension

_SOURCE = Path(__file__).resolve().parent / "csrc" / "int4_dequant.cpp"
_CFLAGS = ("-O3", "-march=native", "-fopenmp")
EXTENSION = CpuExtension("int4_dequant", _SOURCE, _CFLAGS)
BLOCK_N = 64  # output rows per block of the packed layout


def load_int4_dequant():
    """Compile (first call on a machine, ~30 s) or load the extension; None if unavailable."""
    return EXTENSION.load()


def scale_and_shift(scales_and_zeros: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The kernel's float32 `scale, shift [groups, N]` from `scales_and_zeros [groups, N, 2]`
    (the weight-only kernel's form: value = (q - 8) * scale + zero): shift = zero - 8 * scale."""
    sz = scales_and_zeros.float()
    scale = sz[..., 0].contiguous()
    return scale, (sz[..., 1] - 8 * scale).contiguous()


def int4pack_dequant_t(ext, packed: torch.Tensor, scale: torch.Tensor, shift: torch.Tensor,
                       group_size: int) -> torch.Tensor:
    """float32 `W^T [K, N]` from `packed` uint8 `[N, K / 2]` and `scale_and_shift`'s tensors."""
    return ext.int4pack_dequant_t(packed, scale, shift, int(group_size))


def int4pack_linear(ext, x: torch.Tensor, packed: torch.Tensor, scale: torch.Tensor, shift: torch.Tensor,
                    group_size: int, chunk: int = 512) -> torch.Tensor:
    """float32 `x [M, K] @ W^T`, de-quantizing `chunk` output columns at a time into one reused
    buffer (it stays in cache) and multiplying each into its columns of the output."""
    n, k = packed.shape[0], packed.shape[1] * 2
    xf = x.float()
    out = torch.empty(x.shape[0], n, dtype=torch.float32)
    buf = torch.empty(k * min(chunk, n), dtype=torch.float32)
    for start in range(0, n, chunk):
        end = min(start + chunk, n)
        w_t = buf[: k * (end - start)].view(k, end - start)
        ext.int4pack_dequant_t_into(packed, scale, shift, int(group_size), start, end, w_t)
        torch.mm(xf, w_t, out=out[:, start:end])
    return out


def reference_int4pack_dequant_t(packed: torch.Tensor, scale: torch.Tensor, shift: torch.Tensor,
                                 group_size: int) -> torch.Tensor:
    """Plain torch: unpack the nibbles block by block, then q * scale + shift per group."""
    n, half = packed.shape
    k = half * 2
    blocks = packed.view(n // BLOCK_N, k, BLOCK_N // 2)
    codes = torch.cat((blocks & 0x0F, blocks >> 4), dim=2)  # [N / 64, K, 64]: rows of each block
    codes_t = codes.permute(1, 0, 2).reshape(k, n).float()  # [K, N]
    groups = torch.arange(k) // group_size
    return codes_t * scale[groups] + shift[groups]
