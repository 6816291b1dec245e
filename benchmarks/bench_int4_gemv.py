"""The native int4 GEMV (kernels/csrc/int4_gemv.h) vs torch's weight-only int4 kernel
(`aten._weight_int4pack_mm_for_cpu`) on the default model's projection shapes, 1-16 rows.

Both read the same packed weight (torch's CPU int4 layout, group size 32) and the same bf16
scales. Each round times both sides on every shape (the side going first alternates); a shape's
result is the median over rounds of (torch time / native time), every round printed. Also the
effective weight read rate of the native kernel (packed bytes / time).

    PYTHONPATH=. .venv/bin/python benchmarks/bench_int4_gemv.py [--rounds 7] [--threads 2] [--isa avx2]

Writes benchmarks/results/{--name, default bench_int4_gemv}.{json,md}.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from benchmarks._common import RESULTS, cpu_description, result_path  # noqa: E402
from pagedserve.engine.model.quant_linear import Int4Linear  # noqa: E402
from pagedserve.kernels.cpu_int4_dequant import packed_block_n, scale_and_shift  # noqa: E402
from pagedserve.kernels.cpu_native import load_native  # noqa: E402

SHAPES = {"qkv": (576, 960), "o": (576, 576), "gate_up": (576, 3072), "down": (1536, 576)}


def _time(fn, calls: int) -> float:
    """The median of `calls` timed calls (a busy machine's descheduled calls do not count)."""
    fn()
    times = []
    for _ in range(calls):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--rounds", type=int, default=7)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--rows", default="1,4,16")
    ap.add_argument("--isa", default="", help="force the native kernel's path (avx2, avx512, ...)")
    ap.add_argument("--calls", type=int, default=200)
    ap.add_argument("--name", default="bench_int4_gemv")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    ext = load_native()
    if ext is None:
        sys.exit("the native extension cannot be built here")
    gen = torch.Generator().manual_seed(0)
    cases = []
    for name, (in_f, out_f) in SHAPES.items():
        layer = Int4Linear(in_f, out_f, False, torch.bfloat16, 32)
        layer.quantize_rows(0, torch.randn(out_f, in_f, generator=gen))
        scale, shift = scale_and_shift(layer.scales_and_zeros)
        for rows in (int(r) for r in args.rows.split(",")):
            x = torch.randn(rows, in_f, generator=gen).bfloat16()
            cases.append((f"{name} {in_f}x{out_f} rows {rows}", layer, x, scale, shift))
    block_n = packed_block_n()
    ratios: dict[str, list[float]] = {c[0]: [] for c in cases}
    native_s: dict[str, list[float]] = {c[0]: [] for c in cases}
    for r in range(args.rounds):
        for label, layer, x, scale, shift in cases:

            def torch_side(x=x, layer=layer):
                torch.ops.aten._weight_int4pack_mm_for_cpu(x, layer.packed, 32, layer.scales_and_zeros)

            def native_side(x=x, layer=layer, scale=scale, shift=shift):
                ext.int4pack_gemv(x.float(), layer.packed, scale, shift, 32, block_n, isa=args.isa).bfloat16()

            sides = [torch_side, native_side] if r % 2 == 0 else [native_side, torch_side]
            times = {fn.__name__: _time(fn, args.calls) for fn in sides}
            ratios[label].append(times["torch_side"] / times["native_side"])
            native_s[label].append(times["native_side"])
        print(f"round {r}: " + " ".join(f"{v[-1]:.2f}" for v in ratios.values()), file=sys.stderr, flush=True)
    lines = [
        f"# native int4 GEMV vs torch's int4 kernel ({args.threads} threads, isa {ext.cpu_isa(args.isa)})",
        "",
        f"CPU: {cpu_description()}; {args.rounds} paired rounds; busy machine (other jobs running)",
        "",
        "| shape | torch / native time per round | median speed-up | native GB/s (packed weight) |",
        "| --- | --- | --- | --- |",
    ]
    summary = {}
    for label, layer, *_ in cases:
        med = statistics.median(ratios[label])
        gbs = layer.packed.numel() / statistics.median(native_s[label]) / 1e9
        summary[label] = {"speedup": med, "rounds": ratios[label], "native_gbs": gbs}
        lines.append(f"| {label} | {' '.join(f'{x:.2f}' for x in ratios[label])} | {med:.2f} | {gbs:.1f} |")
    RESULTS.mkdir(exist_ok=True)
    result_path(args.name, "json").write_text(json.dumps({"cpu": cpu_description(), **summary}, indent=1))
    result_path(args.name, "md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
