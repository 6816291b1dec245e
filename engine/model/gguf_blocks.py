"""GGUF quantized blocks decoded in torch: Q4_0, Q4_1, Q8_0, Q4_K and Q6_K.

Each decoder takes a tensor's raw bytes as `uint8 [rows, bytes_per_row]` (what `gguf.GGUFReader`
gives for a quantized tensor) and returns float32 `[rows, cols]`, computed with the same float32
operations, in the same order, as the `gguf` package's numpy de-quantizers, so the values are
bit-identical to `gguf.quants.dequantize` (tests/engine/model/test_quant_gguf.py).

The 4-bit types also decode to *int4 groups of 32* without rounding anything: codes `q` in 0..15
with a float32 scale and offset per group such that `value = q * scale + offset` is exactly what
the de-quantizer computes. That is how a GGUF's 4-bit weights reach the engine's int4 layers.
"""

from __future__ import annotations

import enum

import torch

QK_K = 256  # elements in a K-quant super-block


class GGUFBlockType(enum.Enum):
    """The block types decoded here; the value is gguf's GGMLQuantizationType name."""

    Q4_0 = "Q4_0"
    Q4_1 = "Q4_1"
    Q8_0 = "Q8_0"
    Q4_K = "Q4_K"
    Q6_K = "Q6_K"

    @property
    def block(self) -> tuple[int, int]:
        """(elements, bytes) of one block."""
        return _BLOCKS[self]

    @property
    def is_int4(self) -> bool:
        """Decodes losslessly to int4 groups of 32 (`int4_groups`)."""
        return self in (GGUFBlockType.Q4_0, GGUFBlockType.Q4_1, GGUFBlockType.Q4_K)


_BLOCKS = {
    GGUFBlockType.Q4_0: (32, 18),
    GGUFBlockType.Q4_1: (32, 20),
    GGUFBlockType.Q8_0: (32, 34),
    GGUFBlockType.Q4_K: (QK_K, 144),
    GGUFBlockType.Q6_K: (QK_K, 210),
}


def block_type(name: str) -> GGUFBlockType | None:
    """The decodable block type named `name` (a GGMLQuantizationType name), else None."""
    try:
        return GGUFBlockType(name)
    except ValueError:
        return None


def _blocks(raw: torch.Tensor, kind: GGUFBlockType) -> tuple[torch.Tensor, int]:
    """`raw [rows, bytes]` -> `[rows * blocks_per_row, block_bytes]` and the row count."""
    if raw.dtype != torch.uint8 or raw.dim() != 2:
        raise ValueError(f"{kind.value} data must be a 2-D uint8 tensor, got {raw.dtype} {tuple(raw.shape)}")
    elements, nbytes = kind.block
    if raw.shape[1] % nbytes:
        raise ValueError(f"{kind.value} rows must be whole {nbytes}-byte blocks, got {raw.shape[1]} bytes")
    return raw.contiguous().view(-1, nbytes), raw.shape[0]


def _f16(b: torch.Tensor) -> torch.Tensor:
    """`uint8 [n, 2]` little-endian half floats -> float32 `[n, 1]`."""
    return b.contiguous().view(torch.float16).float()


def _nibbles(qs: torch.Tensor, group: int) -> torch.Tensor:
    """`uint8 [n, g, group // 2]` -> `[n, g * group]`: low nibbles first, then high ones."""
    low, high = qs & 0x0F, qs >> 4
    return torch.stack((low, high), dim=-2).reshape(qs.shape[0], -1)


def _q4_0(b: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
    d = _f16(b[:, :2])
    q = _nibbles(b[:, 2:].reshape(-1, 1, 16), 32)
    return q, d, None


def _q4_1(b: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    d, m = _f16(b[:, :2]), _f16(b[:, 2:4])
    return _nibbles(b[:, 4:].reshape(-1, 1, 16), 32), d, m


def _q4_k_scales(scales: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The 8 six-bit scales and mins packed in 12 bytes (gguf's Q4_K.get_scale_min)."""
    s = scales.reshape(-1, 3, 4)
    d, m, m_d = s[:, 0], s[:, 1], s[:, 2]
    sc = torch.cat((d & 0x3F, (m_d & 0x0F) | ((d >> 2) & 0x30)), dim=-1)
    mn = torch.cat((m & 0x3F, (m_d >> 4) | ((m >> 2) & 0x30)), dim=-1)
    return sc, mn


def _q4_k(b: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Per 32-element group: q, d * sc, dmin * m (value = (d * sc) * q - dmin * m)."""
    n = b.shape[0]
    d, dmin = _f16(b[:, :2]), _f16(b[:, 2:4])
    sc, mn = _q4_k_scales(b[:, 4:16])
    scale = d * sc.float()  # [n, 8]
    dm = dmin * mn.float()
    qs = b[:, 16:].reshape(n, 4, 1, 32)
    q = torch.cat((qs & 0x0F, qs >> 4), dim=2).reshape(n, QK_K)
    return q, scale, dm


def decode(raw: torch.Tensor, kind: GGUFBlockType) -> torch.Tensor:
    """De-quantize `raw [rows, bytes]` of `kind` to float32 `[rows, cols]`, as gguf does."""
    blocks, rows = _blocks(raw, kind)
    n = blocks.shape[0]
    if kind is GGUFBlockType.Q8_0:
        d = _f16(blocks[:, :2])
        out = blocks[:, 2:].contiguous().view(torch.int8).float() * d
    elif kind is GGUFBlockType.Q4_0:
        q, d, _ = _q4_0(blocks)
        out = d * (q.to(torch.int8) - 8).float()
    elif kind is GGUFBlockType.Q4_1:
        q, d, m = _q4_1(blocks)
        out = d * q.float() + m
    elif kind is GGUFBlockType.Q4_K:
        q, scale, dm = _q4_k(blocks)
        out = (scale[:, :, None] * q.view(n, 8, 32).float() - dm[:, :, None]).reshape(n, QK_K)
    else:  # Q6_K: ql[128], qh[64], scales int8[16], d
        ql, qh = blocks[:, :128], blocks[:, 128:192]
        scales = blocks[:, 192:208].contiguous().view(torch.int8).float()
        d = _f16(blocks[:, 208:210])
        dsc = (d * scales).reshape(n, 16, 1)
        low = ql.reshape(n, 2, 1, 64)
        low = torch.cat((low & 0x0F, low >> 4), dim=2).reshape(n, 8, 32)
        hq = qh.reshape(n, 2, 1, 32)
        high = torch.cat([(hq >> s) & 0x03 for s in (0, 2, 4, 6)], dim=2).reshape(n, 8, 32)
        q = ((low | (high << 4)).to(torch.int8) - 32).reshape(n, 16, 16).float()
        out = (dsc * q).reshape(n, QK_K)
    return out.reshape(rows, -1)


def int4_groups(raw: torch.Tensor, kind: GGUFBlockType) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Lossless int4 form of a 4-bit tensor: `(codes uint8 [rows, cols] in 0..15, scale, offset)`
    with float32 `scale`, `offset` of shape `[rows, cols // 32]` and
    `codes * scale + offset == decode(raw, kind)` exactly (one multiply, one add, as gguf)."""
    if not kind.is_int4:
        raise ValueError(f"{kind.value} is not a 4-bit type")
    blocks, rows = _blocks(raw, kind)
    if kind is GGUFBlockType.Q4_K:
        q, scale, dm = _q4_k(blocks)
        # value = scale * q - dm; gguf rounds the product then subtracts: q * scale + (-dm) is
        # the same float32 operations (negation is exact, a - b == a + (-b)).
        return q.reshape(rows, -1), scale.reshape(rows, -1), (-dm).reshape(rows, -1)
    if kind is GGUFBlockType.Q4_1:
        q, d, m = _q4_1(blocks)
        return q.reshape(rows, -1), d.reshape(rows, -1), m.reshape(rows, -1)
    # Q4_0: value = d * (q - 8) = d * q - 8 * d only if both products are exact; d is a half
    # float (11-bit significand) and q - 8 fits 4 bits, so d * q and 8 * d are exact in float32
    # and so is their difference's rounding the same as gguf's single product (exact too).
    q, d, _ = _q4_0(blocks)
    return q.reshape(rows, -1), d.reshape(rows, -1), (-8 * d).reshape(rows, -1)
