"""The native int4 GEMV (kernels/csrc/int4_gemv.h) vs torch's weight-only int4 kernel
(`aten._weight_int4pack_mm_for_cpu`) on the default model's projection shapes, 1-16 rows.

Both read the same packed weight (torch's CPU int4 layout, group size 32) and the same bf16
scales. Each shape runs the harness's paired rounds (run_paired: the side going first
alternates; each side's time the median of `--calls` calls); a shape's result is the median over
rounds of (torch time / native time), every round printed. Also the
effective weight read rate of the native kernel (packed bytes / time).

    PYTHONPATH=. .venv/bin/python benchmarks/bench_int4_gemv.py [--rounds 7] [--threads 2] [--isa avx2]

Writes benchmarks/results/bench_int4_gemv.<cpu-kind>.{json,md}.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from benchmarks._common import RESULTS, result_path  # noqa: E402
from pagedserve.engine.model.quant_linear import Int4Linear  # noqa: E402
from pagedserve.kernels.cpu_int4_dequant import packed_block_n, scale_and_shift  # noqa: E402
from pagedserve.kernels.cpu_native import load_native  # noqa: E402
from pagedserve.server.commands.bench.harness import (  # noqa: E402
    PairedRounds,
    median_call_s,
    provenance,
    run_paired,
    stamp,
)

SHAPES = {"qkv": (576, 960), "o": (576, 576), "gate_up": (576, 3072), "down": (1536, 576)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--rounds", type=int, default=7)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--rows", default="1,4,16")
    ap.add_argument("--isa", default="", help="force the native kernel's path (avx2, avx512, ...)")
    ap.add_argument("--calls", type=int, default=200)
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
    paired: dict[str, PairedRounds] = {}
    for label, layer, x, scale, shift in cases:
        sides = {
            "torch": lambda x=x, layer=layer: torch.ops.aten._weight_int4pack_mm_for_cpu(
                x, layer.packed, 32, layer.scales_and_zeros
            ),
            "native": lambda x=x, layer=layer, scale=scale, shift=shift: ext.int4pack_gemv(
                x.float(), layer.packed, scale, shift, 32, block_n, isa=args.isa
            ).bfloat16(),
        }
        print(label, file=sys.stderr, flush=True)
        # candidate / baseline = torch time / native time: the native kernel's speed-up
        paired[label] = run_paired(
            "native",
            "torch",
            lambda side, sides=sides: {"s": median_call_s(sides[side], args.calls)},
            metric="s",
            rounds=args.rounds,
            log=lambda line: print(line, file=sys.stderr, flush=True),
        )
    record = provenance([load for p in paired.values() for load in p.loads])
    lines = [
        f"# native int4 GEMV vs torch's int4 kernel ({args.threads} threads, isa {ext.cpu_isa(args.isa)})",
        "",
        stamp(record),
        "",
        f"{args.rounds} paired rounds per shape, the side going first alternating; each side's time is the "
        f"median of {args.calls} calls.",
        "",
        "| shape | torch / native time per round | median speed-up | native GB/s (packed weight) |",
        "| --- | --- | --- | --- |",
    ]
    summary = {}
    for label, layer, *_ in cases:
        p = paired[label]
        gbs = layer.packed.numel() / p.side_median("native") / 1e9
        summary[label] = {"speedup": p.ratio_median, "rounds": p.ratios, "native_gbs": gbs}
        lines.append(f"| {label} | {' '.join(f'{x:.2f}' for x in p.ratios)} | {p.ratio_median:.2f} | {gbs:.1f} |")
    RESULTS.mkdir(exist_ok=True)
    result_path("bench_int4_gemv", "json").write_text(json.dumps({**record, **summary}, indent=1))
    result_path("bench_int4_gemv", "md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
