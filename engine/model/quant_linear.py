"""Quantized linear layers for CPU inference: int8 and int4 weight-only, and W8A8.

- `Int8Linear`: int8 weights, one float scale per output channel (symmetric). Few rows (decode)
  run weight-only (activations stay in the model dtype): up to 16 rows the native extension's
  int8 GEMV (kernels/csrc/proj_gemv.h, the fused decode layer's), or without it
  `aten._weight_int8pack_mm`; the LM head, weight-only at every row count, widens chunks of its
  weight to float32 for calls of more rows. Weight-only loses to bf16 from a few dozen rows on.
  More rows run `torch._int_mm` (VNNI int8 dot products) on
  activations quantized per token at run time, the call's largest input channels kept apart in
  float32 (`_w8a8_mm`; the quantization and the rescaling with the outlier product run as one
  C++ pass each, kernels/csrc/int8_mm_io.cpp): mode `w8a8` at every row count (its weight stored as `[K, N]` for
  that), mode `int8` for 17..255 rows (batched decode) where the CPU has VNNI; mode `int8`
  de-quantizes the weight for calls of 256+ rows (17+ without VNNI, where `torch._int_mm` is
  emulated) and uses `F.linear` (without bf16 dot products: float32 GEMMs on chunks of the
  weight widened in cache), so prefill keeps weight-only numerics.
- `Int4Linear`: 4-bit codes in groups of 32/64/128 along the input, asymmetric (a scale and an
  offset per group: `w = q * scale + offset`). Few rows run `aten._weight_int4pack_mm_for_cpu`;
  more rows de-quantize the weight for that call with the int4_dequant C++ kernel (one pass
  from the packed layout to float32 `W^T`; on a CPU without bf16 dot products 512 columns at a
  time, each chunk multiplied in float32 while it is in cache) and run GEMMs on it. Without that extension the
  de-quantization is plain torch (~100x slower), and a CPU without bf16 dot products then keeps
  the weight-only kernel at every row count.
- `Int8Embedding`: the token table as int8 rows with a scale each; with tied embeddings the
  LM head is an `Int8Linear` over the same storage.

Each layer's `reference_weight()` is the float32 weight its kernels multiply by (scales rounded
to the model dtype as the kernels use them): tests compare against `x @ reference_weight().T`.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from pagedserve.engine.model.quant_spec import INT4_GROUP_SIZES, QuantMethod
from pagedserve.kernels.cpu_int4_dequant import (
    int4pack_dequant_t,
    int4pack_linear,
    packed_block_n,
    scale_and_shift,
    unpack_codes,
)
from pagedserve.kernels.cpu_isa import cpu_has_bf16_dot, cpu_has_vnni

INT8_WEIGHT_ONLY_MAX_ROWS = 16  # more rows: torch._int_mm on activations quantized per token
# Mode int8 from this many rows on (prefill-sized calls) de-quantizes the weight for the call:
# the copy's cost is spread over enough rows to stay within a few % of bf16, and prefill keeps
# weight-only numerics. Batched decode steps (17..255 rows) run torch._int_mm instead.
INT8_DEQUANT_MIN_ROWS = 256
INT4_KERNEL_MAX_ROWS = 32  # more rows de-quantize the weight for the call and use F.linear
# The LM head (49152 x 576 here) sees at most one row per sequence: de-quantizing it per call
# would cost far more than the weight-only kernel at any batch size, so it always uses the kernel.
HEAD_WEIGHT_ONLY_MAX_ROWS = 1 << 62
# Calls of up to this many rows run the native int4 GEMV (kernels/csrc/int4_gemv.h) where the
# native extension is loaded, instead of torch's weight-only int4 kernel
# (benchmarks/results/bench_int4_gemv*.md).
INT4_GEMV_MAX_ROWS = 16
_INT4_BLOCK_N = 64  # the packed layout's block under AVX-512 (32 under AVX2): archives load on both


def int4_kernel_max_rows() -> int:
    """Rows up to which int4 runs its weight-only kernel: INT4_KERNEL_MAX_ROWS where bf16 GEMMs
    are native; on a CPU without bf16 dot products the kernel beat de-quantize + bf16 GEMM at
    every row count measured (1-512), so it always runs."""
    return INT4_KERNEL_MAX_ROWS if cpu_has_bf16_dot() else 1 << 62


def quantize_int8(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Symmetric per-row int8: `(q int8 [N, K] in -127..127, scale float32 [N])`."""
    w = weight.float()
    scale = w.abs().amax(dim=1).clamp_min(1e-12) / 127
    q = torch.round(w / scale[:, None]).clamp_(-127, 127).to(torch.int8)
    return q, scale


def quantize_int4(weight: torch.Tensor, group_size: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Asymmetric int4 per group of `group_size` inputs: `(codes uint8 [N, K] in 0..15, scale,
    offset)` with float32 `scale`/`offset [N, K / group_size]`, `w ~ codes * scale + offset`."""
    rows, cols = weight.shape
    check_group_size(cols, group_size)
    w = weight.float().reshape(rows, cols // group_size, group_size)
    low, high = w.amin(dim=-1), w.amax(dim=-1)
    scale = ((high - low) / 15).clamp_min(1e-12)
    codes = torch.round((w - low[..., None]) / scale[..., None]).clamp_(0, 15).to(torch.uint8)
    return codes.reshape(rows, cols), scale, low


def check_group_size(in_features: int, group_size: int) -> None:
    if group_size not in INT4_GROUP_SIZES:
        raise ValueError(f"int4 group size must be one of {INT4_GROUP_SIZES}, got {group_size}")
    if in_features % group_size:
        raise ValueError(
            f"int4 group size {group_size} does not divide the layer's {in_features} "
            f"input features; choose one of "
            f"{[g for g in INT4_GROUP_SIZES if in_features % g == 0] or 'none: use int8'}"
        )


def pack_nibbles(codes: torch.Tensor) -> torch.Tensor:
    """uint8 codes `[N, K]` (0..15) -> `[N, K / 2]`, even inputs in the low nibble (storage form)."""
    return codes[:, 0::2] | (codes[:, 1::2] << 4)


def unpack_nibbles(packed: torch.Tensor) -> torch.Tensor:
    return torch.stack((packed & 0x0F, packed >> 4), dim=-1).reshape(packed.shape[0], -1)


# W8A8: this many input channels with the largest |x| in a call stay out of the int8 product and
# are multiplied in float32 (LLM.int8()-style outlier decomposition): a few activation channels
# of the default model are 10-100x the rest, and quantizing them per token crushes every other
# channel of that token to a handful of levels.
W8A8_OUTLIER_CHANNELS = 8


def _w8a8_mm(
    x: torch.Tensor, qweight: torch.Tensor, scale: torch.Tensor, outliers: int = W8A8_OUTLIER_CHANNELS, io=None
) -> torch.Tensor:
    """`x [M, K]` quantized per row to int8 (symmetric), `torch._int_mm` with int32 sums, rescaled;
    the `outliers` input channels of largest max |x| over the call's rows are left out of the
    int8 product and added back as a float32 product with the same int8 weight columns.
    `io`: the loaded int8_mm_io extension (pagedserve.kernels.cpu_int8_mm_io), which does the quantization
    and the rescaling with the outlier product as one C++ pass each; None: torch ops (the reference)."""
    outliers = min(outliers, x.shape[1])
    if io is not None and x.dtype in (torch.float32, torch.bfloat16):
        xq, x_scale, x_out, cols = io.int8_quantize_rows(x.contiguous(), outliers)
        w_out = qweight[:, cols].t().float().contiguous()
        return io.int8_mm_epilogue(
            torch._int_mm(xq, qweight.t()), x_scale, scale, x_out, w_out, x.dtype == torch.bfloat16
        )
    xf = x.float() if x.dtype != torch.float32 else x.clone()  # quantized in place below: never the caller's
    if outliers:
        cols = xf.abs().amax(dim=0).topk(outliers).indices
        extra = xf[:, cols] @ qweight[:, cols].float().t()
        xf = xf.index_fill(1, cols, 0.0)
    x_scale = xf.abs().amax(dim=1, keepdim=True).clamp_min(1e-12) / 127
    xq = torch.round(xf.div_(x_scale)).to(torch.int8)  # |x| / x_scale <= 127 by construction
    # One pass per step over the [M, N] result: int32 * float32 -> float32, then in place.
    acc = torch.mul(torch._int_mm(xq, qweight.t()), x_scale)
    if outliers:
        acc += extra
    return acc.mul_(scale).to(x.dtype)


class _QuantBase(nn.Module):
    """Shared by the quantized layers: shape check, rows view, bias, row-wise loading count."""

    def __init__(self, in_features: int, out_features: int, bias: bool, dtype: torch.dtype) -> None:
        super().__init__()
        self.in_features, self.out_features, self.dtype = in_features, out_features, dtype
        self.bias = nn.Parameter(torch.empty(out_features, dtype=dtype), requires_grad=False) if bias else None
        self.rows_loaded = 0

    def _rows(self, x: torch.Tensor) -> torch.Tensor:
        if x.shape[-1] != self.in_features:
            raise ValueError(f"expected {self.in_features} input features, got {x.shape[-1]}")
        return x.reshape(-1, self.in_features).contiguous()

    def _finish(self, out: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
        if self.bias is not None:
            out = out + self.bias
        return out.view(*x.shape[:-1], self.out_features)

    def _check_range(self, start: int, rows: int) -> None:
        if start < 0 or start + rows > self.out_features:
            raise ValueError(f"rows {start}..{start + rows} outside {self.out_features} output features")

    def _count(self, rows: int) -> None:
        self.rows_loaded += rows
        if self.rows_loaded == self.out_features:
            self.finalize()

    def finalize(self) -> None:
        """Called once every output row is loaded: build the kernels' layouts."""

    def quantize_rows(self, start: int, weight: torch.Tensor) -> None:
        raise NotImplementedError


class Int8Linear(_QuantBase):
    """int8 per-output-channel weights; see the module docstring for the kernels per row count."""

    qweight: torch.Tensor  # buffers (register_buffer)
    scale: torch.Tensor
    kernel_scale: torch.Tensor

    def __init__(
        self,
        in_features: int,
        out_features: int,
        bias: bool,
        dtype: torch.dtype,
        weight_only_max_rows: int = INT8_WEIGHT_ONLY_MAX_ROWS,
        dequant_min_rows: int = INT8_DEQUANT_MIN_ROWS,
        w8a8: bool = False,
        io=None,
    ) -> None:
        super().__init__(in_features, out_features, bias, dtype)
        self.io = io  # the int8_mm_io extension for `_w8a8_mm`, or None
        # Rows <= weight_only_max_rows: weight-only kernel; < dequant_min_rows: torch._int_mm on
        # activations quantized per token; more: the weight de-quantized for the call.
        if w8a8:  # torch._int_mm at every row count
            weight_only_max_rows, dequant_min_rows = 0, 1 << 62
        elif not cpu_has_vnni():
            # Without int8 dot products torch._int_mm is emulated (~5x slower than bf16): every
            # call above the weight-only kernel's rows de-quantizes instead.
            dequant_min_rows = min(dequant_min_rows, weight_only_max_rows + 1)
        self.weight_only_max_rows, self.dequant_min_rows = weight_only_max_rows, dequant_min_rows
        if w8a8:
            # Only torch._int_mm reads the weight, and it ran ~2.5x faster on a contiguous [K, N]
            # int8 matrix than on the transpose of [N, K] at 1,000 rows: `qweight` is the [N, K]
            # view of such storage (row-wise loading and the outlier columns work on the view).
            qweight = torch.empty(in_features, out_features, dtype=torch.int8).t()
        else:
            qweight = torch.empty(out_features, in_features, dtype=torch.int8)
        self.register_buffer("qweight", qweight)
        self.register_buffer("scale", torch.empty(out_features, dtype=torch.float32))
        self.register_buffer("kernel_scale", torch.empty(out_features, dtype=dtype))

    @classmethod
    def sharing(
        cls,
        qweight: torch.Tensor,
        scale: torch.Tensor,
        dtype: torch.dtype,
        weight_only_max_rows: int = HEAD_WEIGHT_ONLY_MAX_ROWS,
        io=None,
    ) -> Int8Linear:
        """A bias-free layer over existing int8 storage (the tied LM head over the embedding)."""
        with torch.device("meta"):
            layer = cls(qweight.shape[1], qweight.shape[0], False, dtype, weight_only_max_rows, io=io)
        layer.qweight, layer.scale = qweight, scale
        layer.kernel_scale = scale.to(dtype)
        layer.rows_loaded = layer.out_features
        return layer

    def set_rows(self, start: int, qweight: torch.Tensor, scale: torch.Tensor) -> None:
        self._check_range(start, qweight.shape[0])
        self.qweight[start : start + qweight.shape[0]].copy_(qweight)
        self.scale[start : start + qweight.shape[0]].copy_(scale)
        self._count(qweight.shape[0])

    def quantize_rows(self, start: int, weight: torch.Tensor) -> None:
        self.set_rows(start, *quantize_int8(weight))

    def finalize(self) -> None:
        self.kernel_scale.copy_(self.scale)

    def reference_weight(self) -> torch.Tensor:
        """What the weight-only paths multiply by (the W8A8 path uses the float32 scale)."""
        return self.qweight.float() * self.kernel_scale.float()[:, None]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        rows = self._rows(x)
        few = rows.shape[0] <= min(self.weight_only_max_rows, INT8_WEIGHT_ONLY_MAX_ROWS)
        if self.io is not None and few:
            out = self.io.int8_linear_few_rows(rows.to(self.dtype), self.qweight, self.kernel_scale)
        elif few or (rows.shape[0] <= self.weight_only_max_rows and rows.device.type != "cpu"):
            out = torch.ops.aten._weight_int8pack_mm(rows.to(self.dtype), self.qweight, self.kernel_scale)
        elif rows.shape[0] <= self.weight_only_max_rows:
            # The LM head above 16 rows: aten's weight-only kernel took 105-134 ms at 64 rows of
            # the 49152 x 576 head where float32 GEMMs on chunks widened in cache take ~42.
            out = _chunked_int8_linear(rows, self.qweight, self.kernel_scale)
        elif rows.shape[0] < self.dequant_min_rows:
            out = _w8a8_mm(rows, self.qweight, self.scale, io=self.io)
        elif not cpu_has_bf16_dot() and rows.device.type == "cpu":
            out = _chunked_int8_linear(rows, self.qweight, self.kernel_scale)
        else:
            out = _dequantized_linear(
                rows, lambda dtype: self.qweight.to(dtype) * self.kernel_scale[:, None].to(dtype), self.dtype
            )
        return self._finish(out.to(x.dtype), x)


class Int4Linear(_QuantBase):
    """int4 weights in groups along the input, asymmetric; see the module docstring."""

    codes: torch.Tensor  # buffers (register_buffer)
    scale: torch.Tensor
    offset: torch.Tensor
    packed: torch.Tensor
    scales_and_zeros: torch.Tensor

    def __init__(
        self,
        in_features: int,
        out_features: int,
        bias: bool,
        dtype: torch.dtype,
        group_size: int = 32,
        kernel_max_rows: int | None = None,
        dequant=None,
    ) -> None:
        super().__init__(in_features, out_features, bias, dtype)
        check_group_size(in_features, group_size)
        if out_features % _INT4_BLOCK_N:
            raise ValueError(f"int4 needs output features divisible by {_INT4_BLOCK_N}, got {out_features}; use int8")
        self.group_size = group_size
        # `dequant`: the loaded int4_dequant extension (pagedserve.kernels.cpu_int4_dequant), which makes
        # de-quantizing for a call cheap (~0.2 ms for 1536 x 576 on one thread): calls above
        # INT4_KERNEL_MAX_ROWS rows then run one GEMM on the de-quantized weight on every CPU.
        self.dequant = dequant
        if kernel_max_rows is None:
            kernel_max_rows = INT4_KERNEL_MAX_ROWS if dequant is not None else int4_kernel_max_rows()
        self.kernel_max_rows = kernel_max_rows
        groups = in_features // group_size
        # Loading form (codes, float32 scale/offset), replaced by the kernel's layout in finalize.
        self.register_buffer("codes", torch.empty(out_features, in_features, dtype=torch.uint8))
        self.register_buffer("scale", torch.empty(out_features, groups, dtype=torch.float32))
        self.register_buffer("offset", torch.empty(out_features, groups, dtype=torch.float32))
        self.register_buffer("packed", torch.empty(out_features, in_features // 2, dtype=torch.uint8))
        self.register_buffer("scales_and_zeros", torch.empty(groups, out_features, 2, dtype=dtype))

    def set_rows(self, start: int, codes: torch.Tensor, scale: torch.Tensor, offset: torch.Tensor) -> None:
        rows = codes.shape[0]
        self._check_range(start, rows)
        if scale.shape != (rows, self.in_features // self.group_size):
            raise ValueError(
                f"int4 scales of shape {tuple(scale.shape)} do not match group size "
                f"{self.group_size} over {self.in_features} inputs"
            )
        self.codes[start : start + rows].copy_(codes)
        self.scale[start : start + rows].copy_(scale)
        self.offset[start : start + rows].copy_(offset)
        self._count(rows)

    def quantize_rows(self, start: int, weight: torch.Tensor) -> None:
        self.set_rows(start, *quantize_int4(weight, self.group_size))

    def finalize(self) -> None:
        # The kernel computes (q - 8) * scale + zero, so zero = offset + 8 * scale.
        self.packed = torch.ops.aten._convert_weight_to_int4pack_for_cpu(self.codes.to(torch.int32), 2)
        zero = self.offset + 8 * self.scale
        self.scales_and_zeros = torch.stack((self.scale, zero), dim=-1).transpose(0, 1).contiguous().to(self.dtype)
        self.gemv_scale_shift = scale_and_shift(self.scales_and_zeros)  # the native GEMV's float32 form
        empty = torch.empty(0, dtype=torch.uint8)
        self.codes, self.scale, self.offset = empty, empty.float(), empty.float()

    def dequantized(self, dtype: torch.dtype) -> torch.Tensor:
        groups = self.in_features // self.group_size
        q = unpack_codes(self.packed, packed_block_n()).view(self.out_features, groups, self.group_size).to(dtype) - 8
        sz = self.scales_and_zeros.to(dtype).transpose(0, 1)  # [N, groups, 2]
        return (q * sz[..., :1] + sz[..., 1:]).view(self.out_features, self.in_features)

    def reference_weight(self) -> torch.Tensor:
        return self.dequantized(torch.float32)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        rows = self._rows(x).to(self.dtype)
        if self.dequant is not None and rows.shape[0] <= INT4_GEMV_MAX_ROWS:
            out = self.dequant.int4pack_gemv(
                rows.float(), self.packed, *self.gemv_scale_shift, self.group_size, packed_block_n()
            )
        elif rows.shape[0] <= self.kernel_max_rows:
            out = torch.ops.aten._weight_int4pack_mm_for_cpu(rows, self.packed, self.group_size, self.scales_and_zeros)
        elif self.dequant is not None and not cpu_has_bf16_dot():
            # float32 GEMMs on cache-sized de-quantized chunks (bf16 GEMMs are emulated here).
            out = int4pack_linear(
                self.dequant, rows, self.packed, *scale_and_shift(self.scales_and_zeros), self.group_size
            )
        elif self.dequant is not None:  # one bf16 GEMM on the whole de-quantized weight
            weight_t = int4pack_dequant_t(
                self.dequant, self.packed, *scale_and_shift(self.scales_and_zeros), self.group_size
            )
            out = F.linear(rows, weight_t.to(self.dtype).t())
        else:
            out = _dequantized_linear(rows, self.dequantized, self.dtype)
        return self._finish(out.to(x.dtype), x)


def _chunked_int8_linear(
    rows: torch.Tensor, qweight: torch.Tensor, scale: torch.Tensor, chunk: int = 512
) -> torch.Tensor:
    """`rows @ (qweight * scale[:, None]).T` in float32: the int8 weight widened to float32 `chunk`
    output rows at a time into one reused buffer (it stays in cache, as UpcastLinear does for
    bf16 weights), each chunk's columns scaled after its GEMM. The LM head above 16 rows, and
    prefill-sized calls on a CPU without bf16 dot products."""
    xf = rows.float()
    n, k = qweight.shape
    out = torch.empty(rows.shape[0], n, dtype=torch.float32)
    buf = torch.empty(min(chunk, n), k, dtype=torch.float32)
    scale_f = scale.float()
    for start in range(0, n, chunk):
        end = min(start + chunk, n)
        w = buf[: end - start]
        w.copy_(qweight[start:end])
        cols = out[:, start:end]
        torch.mm(xf, w.t(), out=cols)
        cols.mul_(scale_f[start:end])
    return out


def _dequantized_linear(rows: torch.Tensor, weight_in, dtype: torch.dtype) -> torch.Tensor:
    """`rows @ weight.T` with the weight de-quantized for this call by `weight_in(dtype)`: in
    `dtype`, except bf16 on a CPU without bf16 dot products, which multiplies in float32 (an
    emulated bf16 GEMM is ~4-5x slower there, pagedserve.kernels.cpu_isa)."""
    if dtype == torch.bfloat16 and rows.device.type == "cpu" and not cpu_has_bf16_dot():
        return F.linear(rows.float(), weight_in(torch.float32)).to(dtype)
    return F.linear(rows.to(dtype), weight_in(dtype))


class Int8Embedding(nn.Module):
    """Token embedding stored as int8 rows with a float32 scale each (looked up, then scaled)."""

    qweight: torch.Tensor  # buffers (register_buffer)
    scale: torch.Tensor

    def __init__(self, num_embeddings: int, embedding_dim: int, dtype: torch.dtype) -> None:
        super().__init__()
        self.dtype = dtype
        self.register_buffer("qweight", torch.empty(num_embeddings, embedding_dim, dtype=torch.int8))
        self.register_buffer("scale", torch.empty(num_embeddings, dtype=torch.float32))

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return (self.qweight[ids].float() * self.scale[ids, None]).to(self.dtype)

    def set_weight(self, weight: torch.Tensor) -> None:
        q, s = quantize_int8(weight)
        self.set_quantized(q, s)

    def set_quantized(self, qweight: torch.Tensor, scale: torch.Tensor) -> None:
        self.qweight.copy_(qweight)
        self.scale.copy_(scale)


def make_quant_linear(
    method: QuantMethod,
    in_features: int,
    out_features: int,
    bias: bool,
    dtype: torch.dtype,
    group_size: int,
    int4_dequant=None,
    int8_mm_io=None,
) -> _QuantBase:
    """The quantized layer of `method`; `int4_dequant` is the loaded int4_dequant extension
    (`pagedserve.kernels.cpu_int4_dequant.load_int4_dequant()`) for int4, `int8_mm_io` the int8_mm_io one
    (`pagedserve.kernels.cpu_int8_mm_io.load_int8_mm_io()`) for int8 / w8a8, or None."""
    if method is QuantMethod.INT8:
        return Int8Linear(in_features, out_features, bias, dtype, io=int8_mm_io)
    if method is QuantMethod.W8A8:
        return Int8Linear(in_features, out_features, bias, dtype, w8a8=True, io=int8_mm_io)
    if method is QuantMethod.INT4:
        return Int4Linear(in_features, out_features, bias, dtype, group_size, dequant=int4_dequant)
    raise ValueError(f"no quantized layer for {method.value}")
