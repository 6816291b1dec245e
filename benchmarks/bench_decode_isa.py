"""Paged decode attention per instruction-set path of the native extension, SmolLM2-135M shapes
(9 query heads, 3 KV heads, head_dim 64, 16-token blocks), one layer.

`avx2` is the path an AVX2-only CPU runs (forced on an AVX-512 machine with isa=). `scalar` is
this build's baseline path (plain x86-64, no -ffast-math): NOT the old AVX2 build, whose scalar
loops were compiled with -march=native -ffast-math and so auto-vectorised; the speed-ups over
`scalar` overstate the gain on an AVX2 CPU, the avx2 : avx512 ratios are the informative part.
Each case runs the harness's alternating rounds (every path once per round, each the median of
`--calls` calls, the order reversed every other round); a path's result is the median over
rounds of (scalar time / its time), every round printed.

    PYTHONPATH=. .venv/bin/python benchmarks/bench_decode_isa.py [--rounds 5] [--batch 1,16] [--context 1000]

Writes benchmarks/results/bench_decode_isa.<cpu-kind>.{json,md}.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from benchmarks._common import RESULTS, result_path  # noqa: E402
from pagedserve.engine.attention.kv_dtype import KVCacheDtype  # noqa: E402
from pagedserve.engine.attention.kv_quant import quantize_kv  # noqa: E402
from pagedserve.kernels.cpu_native import available_isas, load_native  # noqa: E402
from pagedserve.server.commands.bench.harness import (  # noqa: E402
    PairedRounds,
    alternating_rounds,
    median_call_s,
    provenance,
    stamp,
)


def _case(batch: int, context: int, kv: str):
    g = torch.Generator().manual_seed(batch)
    blocks = -(-context // 16)
    k = torch.randn(batch * blocks, 16, 3, 64, generator=g).bfloat16()
    v = torch.randn(batch * blocks, 16, 3, 64, generator=g).bfloat16()
    if kv != "bf16":
        k, v = quantize_kv(k.float(), KVCacheDtype(kv)), quantize_kv(v.float(), KVCacheDtype(kv))
    tables = torch.randperm(batch * blocks, generator=g).view(batch, blocks).int()
    q = torch.randn(batch, 9, 64, generator=g).bfloat16()
    return q, k, v, tables, torch.full((batch,), context, dtype=torch.int32), "" if kv == "bf16" else kv


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--batch", default="1,16")
    ap.add_argument("--context", type=int, default=1000)
    ap.add_argument("--kv", default="bf16,int8")
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--calls", type=int, default=30)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    ext = load_native()
    if ext is None:
        sys.exit("the native extension cannot be built here")
    isas = available_isas(ext)
    cases = {
        f"batch {b} {kv}": _case(int(b), args.context, kv) for b in args.batch.split(",") for kv in args.kv.split(",")
    }
    paired: dict[tuple[str, str], PairedRounds] = {}
    loads: list[float] = []
    for label, (q, k, v, t, lens, kvq) in cases.items():

        def measure(isa: str, q=q, k=k, v=v, t=t, lens=lens, kvq=kvq) -> dict:
            return {
                "s": median_call_s(
                    lambda: ext.paged_decode_attention(q, k, v, t, lens, 0.125, kvq, isa=isa), args.calls
                )
            }

        runs = alternating_rounds(isas, measure, args.rounds)
        loads.append(os.getloadavg()[0])
        for isa in isas:
            # candidate / baseline = scalar time / this path's time: its speed-up over scalar
            paired[(label, isa)] = PairedRounds(isa, "scalar", "s", runs={isa: runs[isa], "scalar": runs["scalar"]})
        ratios = ", ".join(f"{isa} " + " ".join(f"{x:.2f}" for x in paired[(label, isa)].ratios) for isa in isas)
        print(f"{label}, speed-up over scalar per round: {ratios}", file=sys.stderr, flush=True)
    record = provenance(loads)
    lines = [
        f"# paged decode attention per path, context {args.context}, {args.threads} thread(s)",
        "",
        stamp(record),
        "",
        f"{args.rounds} rounds per case, every path once per round, the order reversed every other round; "
        f"each time the median of {args.calls} calls.",
        "",
        "| case | path | speed-up over scalar per round | median |",
        "| --- | --- | --- | --- |",
    ]
    summary = {}
    for (label, isa), p in paired.items():
        summary[f"{label} {isa}"] = {"rounds": p.ratios, "median": p.ratio_median}
        lines.append(f"| {label} | {isa} | {' '.join(f'{x:.2f}' for x in p.ratios)} | {p.ratio_median:.2f} |")
    RESULTS.mkdir(exist_ok=True)
    result_path("bench_decode_isa", "json").write_text(json.dumps({**record, **summary}, indent=1))
    result_path("bench_decode_isa", "md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
