"""What the CPU's instruction set offers the matmuls, read from /proc/cpuinfo (Linux, x86).

Where the flags cannot be read (another OS), the answers are the optimistic defaults: bf16 dot
products present (keep torch's own bf16 GEMMs), VNNI absent (refuse w8a8 rather than emulate it).

`PAGEDSERVE_CPU_ISA` (`avx2`, `avx512`, `scalar`; the native extension's cap, see
pagedserve.kernels.cpu_native) also hides the flags above that level here, so an AVX-512 machine
makes the choices an AVX2-only one makes (with `ATEN_CPU_CAPABILITY=avx2` and
`ONEDNN_MAX_CPU_ISA=AVX2`, torch's own kernels run as they would there too).
"""

from __future__ import annotations

import os

# Flags hidden under each PAGEDSERVE_CPU_ISA cap (prefixes).
_ABOVE = {
    "scalar": ("avx", "fma", "f16c", "amx"),
    "avx2": ("avx512", "amx", "avx_vnni"),
    "avx512": ("avx512_bf16", "amx"),
}


def cpu_flags(cpuinfo: str = "/proc/cpuinfo") -> list[str] | None:
    """The `flags` of the first processor in `cpuinfo`, None where it cannot be read."""
    try:
        with open(cpuinfo, encoding="ascii", errors="replace") as f:
            line = next((line for line in f if line.startswith("flags")), None)
    except OSError:
        return None
    if line is None:
        return None
    hidden = _ABOVE.get(os.environ.get("PAGEDSERVE_CPU_ISA", ""), ())
    return [f for f in line.split(":", 1)[-1].split() if not f.startswith(hidden)]


def cpu_has_vnni(flags: list[str] | None = None) -> bool:
    """True where the CPU reports VNNI int8 dot products (avx512_vnni or avx_vnni) or AMX."""
    flags = cpu_flags() if flags is None else flags
    return flags is not None and any(f in flags for f in ("avx512_vnni", "avx_vnni", "amx_int8"))


def cpu_has_bf16_dot(flags: list[str] | None = None) -> bool:
    """True where the CPU has bf16 dot products (avx512_bf16 or AMX), or its flags are unknown.
    Without them oneDNN emulates bf16 GEMMs: on an Intel Xeon with avx512_vnni but no
    avx512_bf16, a [64, 576] x [576, 1536] bf16 GEMM ran at ~58 GFLOP/s against ~220 in float32
    (2 threads), and at 1,000 rows 60 against 317."""
    flags = cpu_flags() if flags is None else flags
    return flags is None or any(f in flags for f in ("avx512_bf16", "amx_bf16"))
