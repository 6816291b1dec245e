"""The passes around an int8 x int8 product with per-token activation scales and outlier
channels, as C++ (kernels/csrc/int8_mm_io.h in the native extension): `int8_quantize_rows` (the activations quantized,
the outlier channels picked and kept apart) and `int8_mm_epilogue` (`(acc * x_scale[:, None] +
x_out @ w_out) * w_scale`, rounded once to the output dtype). `pagedserve.engine.model.quant_linear._w8a8_mm`
computes the same with torch ops where the extension cannot be built, and is its reference."""

from __future__ import annotations

from pagedserve.kernels.cpu_native import load_native


def load_int8_mm_io():
    """The native extension (pagedserve.kernels.cpu_native), which has these kernels; None if unavailable."""
    return load_native()
