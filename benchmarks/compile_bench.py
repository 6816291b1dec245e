"""Compiled forward (pagedserve.engine.model.compile) vs eager, on the default model, paired rounds.

Cases: batch-1 decode, batch-16 decode (contexts of 256 tokens), one 512-token prefill; each in
float32 and bfloat16 (one process per dtype, run one after the other). Both sides are the same
loaded model in the same process: eager is `model(...)` with the fused CPU ops, compiled is
`CompiledForward` over the case's bucket (compiled once, before timing; the compile time is
reported). Each round times `reps` forwards of each side, the two sides alternating which goes
first; the result is the median of the per-round eager/compiled time ratios (> 1: compiled is
faster), every round's ratio printed. Never best-of.

    .venv/bin/python benchmarks/compile_bench.py [--rounds 7] [--threads 2]

Writes benchmarks/results/compile.<cpu-kind>.{json,md}.
"""

from __future__ import annotations

import argparse
import json
import tempfile
import time
from dataclasses import replace
from pathlib import Path

from _common import RESULTS, result_path, run_phase

from pagedserve.server.commands.bench.harness import provenance, run_paired, stamp

CONTEXT = 256
PREFILL = 512
NUM_BLOCKS = 64


def _cases(torch, AttentionMetadata):
    """(name, tokens, reps, metadata builder) of every case."""

    def decode(batch: int):
        blocks = CONTEXT // 16
        tables = torch.arange(batch * blocks, dtype=torch.int32).view(batch, blocks) % NUM_BLOCKS
        return AttentionMetadata(
            num_seqs=batch,
            num_tokens=batch,
            query_lens=[1] * batch,
            seq_lens=[CONTEXT] * batch,
            query_start_loc=torch.arange(batch + 1, dtype=torch.int32),
            seq_lens_tensor=torch.full((batch,), CONTEXT, dtype=torch.int32),
            block_tables=tables,
            slot_mapping=tables[:, -1].long() * 16 + 15,
            max_query_len=1,
            max_seq_len=CONTEXT,
            num_decodes=batch,
        )

    def prefill():
        return AttentionMetadata(
            num_seqs=1,
            num_tokens=PREFILL,
            query_lens=[PREFILL],
            seq_lens=[PREFILL],
            query_start_loc=torch.tensor([0, PREFILL], dtype=torch.int32),
            seq_lens_tensor=torch.tensor([PREFILL], dtype=torch.int32),
            block_tables=torch.arange(PREFILL // 16, dtype=torch.int32)[None],
            slot_mapping=torch.arange(PREFILL, dtype=torch.int64),
            max_query_len=PREFILL,
            max_seq_len=PREFILL,
            num_decodes=0,
        )

    return [
        ("decode batch 1", 1, 20, lambda: decode(1)),
        ("decode batch 16", 16, 10, lambda: decode(16)),
        (f"prefill {PREFILL}", PREFILL, 2, prefill),
    ]


def run_dtype(dtype_name: str, rounds: int, threads: int, cache_dir: str) -> dict:
    import torch

    from pagedserve.engine.attention.metadata import AttentionMetadata
    from pagedserve.engine.attention.selector import select_backend
    from pagedserve.engine.model.compile import CompiledForward
    from pagedserve.engine.model.default_model import default_model_dir
    from pagedserve.engine.model.loader import allocate_kv_caches, load_model, read_config, select_fused_ops
    from pagedserve.engine.platform.process_setup import tune_glibc_malloc

    tune_glibc_malloc()
    torch.set_num_threads(threads)
    dtype = getattr(torch, dtype_name)
    model_dir = default_model_dir()
    backend = select_backend("cpu")
    fused = select_fused_ops("cpu", dtype)
    # Eager as the engine runs it (bf16 projections packed); the compiled side on plain weights,
    # which inductor freezes and packs itself.
    model = load_model(model_dir, dtype, "cpu", backend, max_model_len=2048, fused_ops=fused)
    plain = load_model(model_dir, dtype, "cpu", backend, max_model_len=2048, fused_ops=fused, pack_linear=False)
    kv = allocate_kv_caches(read_config(model_dir), NUM_BLOCKS, 16, dtype, "cpu")
    cases = _cases(torch, AttentionMetadata)
    compiled = CompiledForward(plain, backend, [tokens for _, tokens, _, _ in cases], cache_dir)
    start = time.perf_counter()
    compiled.warm_up(kv)
    compile_s = time.perf_counter() - start
    gen = torch.Generator().manual_seed(0)
    out = {"dtype": dtype_name, "compile_s": round(compile_s, 1), "cases": {}}
    with torch.inference_mode():
        for name, tokens, reps, make_meta in cases:
            ids = torch.randint(0, model.spec.vocab_size, (tokens,), generator=gen)
            pos = torch.arange(tokens) if tokens == PREFILL else torch.full((tokens,), CONTEXT - 1)
            meta = make_meta()
            sides = {
                "eager": lambda ids=ids, pos=pos, meta=meta: model(ids, pos, kv, meta),
                "compiled": lambda ids=ids, pos=pos, meta=meta: compiled(ids, pos, kv, meta),
            }
            diff = (sides["eager"]().float() - sides["compiled"]().float()).abs().max().item()

            def measure(side: str, sides=sides, reps=reps) -> dict:
                t0 = time.perf_counter()
                for _ in range(reps):
                    sides[side]()
                ms = (time.perf_counter() - t0) / reps * 1e3
                return {"ms": ms, "calls_per_s": 1e3 / ms}

            # compiled / eager calls per second = eager / compiled time, per round
            paired = run_paired(
                "eager", "compiled", measure, metric="calls_per_s", rounds=rounds, log=lambda line: None
            )
            ms = replace(paired, metric="ms")
            out["cases"][name] = {
                "eager_ms_median": round(ms.side_median("eager"), 2),
                "compiled_ms_median": round(ms.side_median("compiled"), 2),
                "ratios": [round(x, 3) for x in paired.ratios],
                "median_ratio": round(paired.ratio_median, 3),
                "max_abs_diff": diff,
                "load_average_per_round": paired.loads,
            }
            print(
                f"{dtype_name} {name}: eager {out['cases'][name]['eager_ms_median']} ms, compiled "
                f"{out['cases'][name]['compiled_ms_median']} ms, rounds {out['cases'][name]['ratios']}, "
                f"median eager/compiled {out['cases'][name]['median_ratio']}",
                flush=True,
            )
    return out


def write_markdown(results: dict, path: Path) -> None:
    lines = [
        "# Compiled forward vs eager (benchmarks/compile_bench.py)",
        "",
        stamp(results),
        "",
        (
            f"Default model, {results['threads']} threads, {results['rounds']} paired rounds (order alternating), "
            "median of per-round eager/compiled time ratios (> 1: compiled faster)."
        ),
        "",
        "| dtype | case | eager ms | compiled ms | eager / compiled (median) | per-round ratios | max abs diff |",
        "| --- | --- | --- | --- | --- | --- | --- |",
    ]
    for d in results["dtypes"]:
        for name, c in d["cases"].items():
            rounds = ", ".join(f"{x:.2f}" for x in c["ratios"])
            lines.append(
                f"| {d['dtype']} | {name} | {c['eager_ms_median']} | {c['compiled_ms_median']} | "
                f"**{c['median_ratio']}** | {rounds} | {c['max_abs_diff']:.3g} |"
            )
    lines += [
        "",
        "Cold compile of the three buckets (1, 16, 512 tokens): "
        + ", ".join(f"{d['dtype']} {d['compile_s']} s" for d in results["dtypes"])
        + ".",
    ]
    path.write_text("\n".join(lines) + "\n")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rounds", type=int, default=7)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--dtypes", default="float32,bfloat16")
    parser.add_argument("--cache-dir", default=None, help="inductor cache (default: a fresh temporary dir)")
    parser.add_argument("--child", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        print(json.dumps(run_dtype(args.child, args.rounds, args.threads, args.cache_dir)))
        return
    results: dict = {"threads": args.threads, "rounds": args.rounds, "dtypes": []}
    with tempfile.TemporaryDirectory() as tmp:
        for dtype in args.dtypes.split(","):
            child = ["--child", dtype, "--rounds", str(args.rounds), "--threads", str(args.threads)]
            results["dtypes"].append(run_phase(__file__, [*child, "--cache-dir", args.cache_dir or tmp], echo=True))
    loads = [x for d in results["dtypes"] for c in d["cases"].values() for x in c["load_average_per_round"]]
    results |= provenance(loads)
    RESULTS.mkdir(exist_ok=True)
    result_path("compile", "json").write_text(json.dumps(results, indent=2) + "\n")
    write_markdown(results, result_path("compile", "md"))
    print(f"{stamp(results)} Wrote {result_path('compile', 'md')}")


if __name__ == "__main__":
    main()
