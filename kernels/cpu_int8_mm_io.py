"""The passes around an int8 x int8 product with per-token activation scales and outlier
channels, as C++ (kernels/csrc/int8_mm_io.cpp): `int8_quantize_rows` (the activations quantized,
the outlier channels picked and kept apart) and `int8_mm_epilogue` (`(acc * x_scale[:, None] +
x_out @ w_out) * w_scale`, rounded once to the output dtype). `engine.model.quant_linear._w8a8_mm`
computes the same with torch ops where the extension cannot be built, and is its reference."""

from __future__ import annotations

from pathlib import Path

from kernels.cpu_build import CpuExtension

_SOURCE = Path(__file__).resolve().parent / "csrc" / "int8_mm_io.cpp"
_CFLAGS = ("-O3", "-march=native", "-fopenmp")
EXTENSION = CpuExtension("int8_mm_io", _SOURCE, _CFLAGS)


def load_int8_mm_io():
    """Compile (first call on a machine, ~30 s) or load the extension; None if unavailable."""
    return EXTENSION.load()
