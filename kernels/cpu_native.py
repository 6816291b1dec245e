"""The one native CPU extension: every C++ kernel of the project in one module
(kernels/csrc/native.cpp and native_avx512.cpp, which include the kernel headers once per
instruction set).

It is built for the portable x86-64 baseline (no -march=native) and picks its instruction set at
run time from the CPU's features: AVX512-BF16, AVX-512 (F/BW/VL/DQ), AVX2 + FMA + F16C, or plain
C++. `PAGEDSERVE_CPU_ISA` (`avx2`, `avx512`, `avx512_bf16`, `scalar`) caps the pick, e.g. to run
an AVX-512 machine the way an AVX2-only one runs; every op also takes `isa=` to force one path
(the tests compare the paths this way). `load_native()` returns the module, or None where it
cannot be built (no compiler) or PAGEDSERVE_DISABLE_CPU_KERNELS=1.

The older per-kernel loaders (`load_cpu_kernels`, `load_fused_ops`, `load_gemv`,
`load_int4_dequant`, `load_int8_mm_io`) all return this module.
"""

from __future__ import annotations

from pathlib import Path

from pagedserve.kernels.cpu_build import CpuExtension

ISA_NAMES = ("scalar", "avx2", "avx512", "avx512_bf16")  # in order: each runs where the next does

_CSRC = Path(__file__).resolve().parent / "csrc"
# No -march: the baseline, with per-function targets inside. No -ffast-math and no FMA
# contraction: the fused ops round exactly where torch does (explicit FMAs are intrinsics).
# -fopenmp makes at::parallel_for use torch's thread pool (same libgomp, already loaded).
_CFLAGS = ("-O3", "-ffp-contract=off", "-fopenmp")
# Two translation units (the AVX-512 regions apart) so a 2-core machine compiles them at once.
EXTENSION = CpuExtension("native", _CSRC / "native.cpp", _CFLAGS, extra_sources=(_CSRC / "native_avx512.cpp",))


def load_native():
    """Compile (first call on a machine, ~1-2 min) or load the extension; None if unavailable."""
    return EXTENSION.load()


def available_isas(ext) -> list[str]:
    """The instruction sets this CPU can run the kernels with, from `scalar` up."""
    best = ISA_NAMES.index(ext.detected_isa())
    return list(ISA_NAMES[: best + 1])
