"""Time to first token of a 1,000-token prompt vs its matmul floor, on the default model.

The floor is the prompt's matmuls alone, with the engine's own layers, shapes and dtype, timed
in the same process: every decoder projection (qkv, o, gate_up, down of each layer) on a
`[1000, in]` input, and the LM head on the last row only (`[1, hidden]`), as the engine runs
it. TTFT is an offline `LLM.generate` of the prompt with `max_tokens=1` (prefix caching off, so
every round prefills the whole prompt; the prompt is token ids, so no tokenizer time). Each
round times both, alternating which goes first; the result is the median of the per-round
TTFT/floor ratios (1.0 would be a prefill that costs nothing but its matmuls), every round
printed, never best-of. The gap is also split into attention (the backend's forward, timed by
a wrapper) and the rest (glue: embedding, norms, RoPE, activations, the runner's step).
float32 and bfloat16, one process each.

    .venv/bin/python benchmarks/prefill_floor.py [--rounds 7] [--tokens 1000] [--threads 2]
"""

from __future__ import annotations

import argparse
import json
import os
import time
from dataclasses import replace
from pathlib import Path

from _common import result_path, run_phase

from pagedserve.server.commands.bench.harness import PairedRounds, alternating_rounds, provenance, stamp


def run_dtype(dtype_name: str, tokens: int, rounds: int, threads: int) -> dict:
    import torch

    from pagedserve.engine import LLM, SamplingParams
    from pagedserve.engine.model.default_model import default_model_dir

    llm = LLM(
        default_model_dir(),
        dtype=dtype_name,
        num_threads=threads,
        enable_prefix_caching=False,
        max_num_batched_tokens=max(2048, tokens),
        kv_cache_memory="256MiB",
    )
    model = llm.engine.runner.model
    backend = llm.engine.runner.backend
    vocab = model.spec.vocab_size
    gen = torch.Generator().manual_seed(0)
    params = SamplingParams(max_tokens=1, temperature=0, ignore_eos=True)

    attention_s = [0.0]
    inner = backend.forward

    def timed_forward(*args, **kwargs):
        start = time.perf_counter()
        try:
            return inner(*args, **kwargs)
        finally:
            attention_s[0] += time.perf_counter() - start

    backend.forward = timed_forward  # instance attribute: this benchmark's engine only

    projections = [getattr(parent, name) for _, parent, name in model._projections()]
    inputs = {p.in_features: torch.randn(tokens, p.in_features, generator=gen).to(model.dtype) for p in projections}
    last_row = torch.randn(1, model.spec.hidden_size, generator=gen).to(model.dtype)

    @torch.inference_mode()
    def floor() -> float:
        start = time.perf_counter()
        for proj in projections:
            proj(inputs[proj.in_features])
        model.compute_logits(last_row)
        return time.perf_counter() - start

    def ttft() -> dict:
        prompt = torch.randint(0, vocab, (tokens,), generator=gen).tolist()
        attention_s[0] = 0.0
        start = time.perf_counter()
        llm.generate([prompt], params)
        return {"s": time.perf_counter() - start, "attention_s": attention_s[0]}

    ttft()
    floor()  # warm-up of both

    def record(r: int, order: tuple[str, ...], got: dict[str, list]) -> None:
        t, f = got["ttft"][-1], got["floor"][-1]
        print(
            f"{dtype_name} round {r}: ttft {t['s'] * 1e3:.0f} ms, floor {f['s'] * 1e3:.0f} ms, attention "
            f"{t['attention_s'] * 1e3:.0f} ms, ratio {t['s'] / f['s']:.3f}",
            flush=True,
        )

    # the shared harness (pagedserve.server.commands.bench.harness): the order reversed every other round
    sides: dict = {"ttft": ttft, "floor": lambda: {"s": floor()}}
    got = alternating_rounds(("ttft", "floor"), lambda side: sides[side](), rounds, on_round=record)
    paired = PairedRounds("floor", "ttft", "s", runs=got)  # TTFT / floor per round
    return {
        "dtype": dtype_name,
        "tokens": tokens,
        "rounds": [
            {"ttft_s": t["s"], "floor_s": f["s"], "attention_s": t["attention_s"], "ratio": ratio}
            for t, f, ratio in zip(got["ttft"], got["floor"], paired.ratios)
        ],
        "median_ratio": round(paired.ratio_median, 3),
        "median_ttft_ms": round(paired.side_median("ttft") * 1e3, 1),
        "median_floor_ms": round(paired.side_median("floor") * 1e3, 1),
        "median_attention_ms": round(replace(paired, metric="attention_s").side_median("ttft") * 1e3, 1),
        "load_average": os.getloadavg()[0],
    }


def write_markdown(results: dict, path: Path) -> None:
    lines = [
        "# Prefill vs matmul floor (benchmarks/prefill_floor.py)",
        "",
        stamp(results),
        "",
        (
            f"{results['tokens']}-token prompt, default model, {results['threads']} threads, {results['rounds']} paired "
            "rounds (order alternating), median of per-round ratios."
        ),
        "",
        "| dtype | TTFT ms | matmul floor ms | attention ms | TTFT / floor (median) | per-round ratios |",
        "| --- | --- | --- | --- | --- | --- |",
    ]
    for d in results["dtypes"]:
        ratios = ", ".join(f"{row['ratio']:.2f}" for row in d["rounds"])
        lines.append(
            f"| {d['dtype']} | {d['median_ttft_ms']} | {d['median_floor_ms']} | {d['median_attention_ms']} | "
            f"**{d['median_ratio']}** | {ratios} |"
        )
    path.write_text("\n".join(lines) + "\n")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rounds", type=int, default=7)
    parser.add_argument("--tokens", type=int, default=1000)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--dtypes", default="float32,bfloat16")
    parser.add_argument("--child", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        print(json.dumps(run_dtype(args.child, args.tokens, args.rounds, args.threads)))
        return
    results: dict = {
        "threads": args.threads,
        "rounds": args.rounds,
        "tokens": args.tokens,
        "dtypes": [],
    }
    for dtype in args.dtypes.split(","):
        child = ["--child", dtype, "--rounds", str(args.rounds), "--tokens", str(args.tokens)]
        results["dtypes"].append(run_phase(__file__, [*child, "--threads", str(args.threads)], echo=True))
    results |= provenance([d["load_average"] for d in results["dtypes"]])
    result_path("prefill_floor", "json").write_text(json.dumps(results, indent=2) + "\n")
    write_markdown(results, result_path("prefill_floor", "md"))
    print(f"wrote {result_path('prefill_floor', 'md')} and .json")


if __name__ == "__main__":
    main()
