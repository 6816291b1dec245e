"""De-quantize int4 weights (torch's CPU int4 packed layout) to a float32 `W^T [K, N]` in one
pass (C++, kernels/csrc/int4_dequant.h in the native extension), for calls with enough rows that one float32 GEMM
beats the weight-only int4 kernel. `load_int4_dequant()` returns None where the extension cannot
be built; `reference_int4pack_dequant_t` is the plain-torch reference.
"""

from __future__ import annotations

import functools

import torch

from pagedserve.kernels.cpu_native import load_native


@functools.cache
def packed_block_n() -> int:
    """Output rows per block of torch's CPU int4 packed layout on this machine: four float
    vectors of torch's CPU capability, 64 under AVX-512 and 32 under AVX2. Read off torch by
    packing a probe weight once, so a torch that changes the rule is caught, not misread."""
    probe = torch.randint(0, 16, (128, 64), generator=torch.Generator().manual_seed(0), dtype=torch.int32)
    packed = torch.ops.aten._convert_weight_to_int4pack_for_cpu(probe, 2)
    for block_n in (64, 32):
        if torch.equal(unpack_codes(packed, block_n), probe.to(torch.uint8)):
            return block_n
    raise RuntimeError("torch's CPU int4 packed layout is neither 32- nor 64-row blocks")


def unpack_codes(packed: torch.Tensor, block_n: int) -> torch.Tensor:
    """Codes uint8 `[N, K]` from `packed` `[N, K / 2]` in blocks of `block_n` output rows: per
    block, `[K, block_n / 2]` bytes whose low nibbles are its first half of rows."""
    n, k = packed.shape[0], packed.shape[1] * 2
    blocks = packed.view(n // block_n, k, block_n // 2)
    return torch.cat((blocks & 0x0F, blocks >> 4), dim=2).permute(0, 2, 1).reshape(n, k)


def load_int4_dequant():
    """The native extension (pagedserve.kernels.cpu_native), which has these kernels; None if unavailable."""
    return load_native()


def scale_and_shift(scales_and_zeros: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The kernel's float32 `scale, shift [groups, N]` from `scales_and_zeros [groups, N, 2]`
    (the weight-only kernel's form: value = (q - 8) * scale + zero): shift = zero - 8 * scale."""
    sz = scales_and_zeros.float()
    scale = sz[..., 0].contiguous()
    return scale, (sz[..., 1] - 8 * scale).contiguous()


def int4pack_dequant_t(
    ext, packed: torch.Tensor, scale: torch.Tensor, shift: torch.Tensor, group_size: int
) -> torch.Tensor:
    """float32 `W^T [K, N]` from `packed` uint8 `[N, K / 2]` and `scale_and_shift`'s tensors."""
    return ext.int4pack_dequant_t(packed, scale, shift, int(group_size), packed_block_n())


def int4pack_linear(
    ext,
    x: torch.Tensor,
    packed: torch.Tensor,
    scale: torch.Tensor,
    shift: torch.Tensor,
    group_size: int,
    chunk: int = 512,
) -> torch.Tensor:
    """float32 `x [M, K] @ W^T`, de-quantizing `chunk` output columns at a time into one reused
    buffer (it stays in cache) and multiplying each into its columns of the output."""
    n, k = packed.shape[0], packed.shape[1] * 2
    block_n = packed_block_n()
    xf = x.float()
    out = torch.empty(x.shape[0], n, dtype=torch.float32)
    buf = torch.empty(k * min(chunk, n), dtype=torch.float32)
    for start in range(0, n, chunk):
        end = min(start + chunk, n)
        w_t = buf[: k * (end - start)].view(k, end - start)
        ext.int4pack_dequant_t_into(packed, scale, shift, int(group_size), block_n, start, end, w_t)
        torch.mm(xf, w_t, out=out[:, start:end])
    return out


def reference_int4pack_dequant_t(
    packed: torch.Tensor, scale: torch.Tensor, shift: torch.Tensor, group_size: int
) -> torch.Tensor:
    """Plain torch: unpack the nibbles, then q * scale + shift per group."""
    codes_t = unpack_codes(packed, packed_block_n()).t().float()  # [K, N]
    groups = torch.arange(codes_t.shape[0]) // group_size
    return codes_t * scale[groups] + shift[groups]
