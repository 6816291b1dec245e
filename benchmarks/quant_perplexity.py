"""Perplexity of the default model under each quantization, on a fixed public-domain English text.

Text: benchmarks/data/coriolanus_act1.txt, the first ~24,000 characters of Shakespeare's
*Coriolanus* (public domain) as in the tinyshakespeare file of karpathy/char-rnn
(data/tinyshakespeare/input.txt), cut at a blank line: 7,310 tokens with the model's tokenizer.

The text is scored in non-overlapping windows of `--window` tokens (default 1024), each one
prefill through the engine's own model and paged KV cache (so prefill-sized row counts pick each
layer's large-row path: w8a8 quantizes activations there, int8 and int4 de-quantize the weight). With a
quantized KV cache the prefill reads every key/value back from the cache, so those rows measure
the KV quantization itself.
Perplexity = exp(mean negative log-likelihood of every token after the first of each window).

    PYTHONPATH=. .venv/bin/python benchmarks/quant_perplexity.py [--window 1024] [--threads 2]

Writes benchmarks/results/quant_perplexity.<cpu-kind>.{json,md}.
"""

from __future__ import annotations

import argparse
import json
import math
import tempfile
import time
from pathlib import Path

import torch
from _common import RESULTS, provenance, result_path, stamp

from pagedserve.engine import LLM
from pagedserve.engine.attention.metadata import AttentionMetadata
from pagedserve.engine.model.default_model import default_gguf_path, default_model_dir
from pagedserve.engine.model.quant_convert import convert_gguf_quantized

TEXT = Path(__file__).parent / "data" / "coriolanus_act1.txt"


def window_nll(llm: LLM, ids: list[int], chunk: int = 0) -> tuple[float, int]:
    """Sum of -log p(token | prefix) over ids[1:], as one prefill of `ids` (or prefill chunks of
    `chunk` tokens, each over the cached context before it); and the count."""
    runner = llm.engine.runner
    n, block = len(ids), runner.block_size
    blocks = torch.arange((n + block - 1) // block, dtype=torch.int32)
    step = chunk or n
    logits = []
    with torch.inference_mode():
        for lo in range(0, n, step):
            hi = min(n, lo + step)
            meta = AttentionMetadata(
                num_seqs=1,
                num_tokens=hi - lo,
                query_lens=[hi - lo],
                seq_lens=[hi],
                query_start_loc=torch.tensor([0, hi - lo], dtype=torch.int32),
                seq_lens_tensor=torch.tensor([hi], dtype=torch.int32),
                block_tables=blocks[None],
                slot_mapping=torch.arange(lo, hi, dtype=torch.int64),
                max_query_len=hi - lo,
                max_seq_len=hi,
                num_decodes=0,
            )
            hidden = runner.model(torch.tensor(ids[lo:hi]), torch.arange(lo, hi), runner.kv_caches, meta)
            logits.append(runner.model.compute_logits(hidden).float())
        logits = torch.cat(logits)[:-1]
        nll = torch.nn.functional.cross_entropy(logits, torch.tensor(ids[1:]), reduction="sum")
    return float(nll), n - 1


def perplexity(llm: LLM, tokens: list[int], window: int, chunk: int = 0) -> float:
    total, count = 0.0, 0
    for start in range(0, len(tokens) - 1, window):
        piece = tokens[start : start + window]
        if len(piece) < 2:
            break
        nll, n = window_nll(llm, piece, chunk)
        total, count = total + nll, count + n
    return math.exp(total / count)


def write_results(rows: list[dict], kept: list[dict], labels: list[str], num_tokens: int, args) -> None:
    """Write benchmarks/results/quant_perplexity.<cpu-kind>.{json,md}: this run's rows, then the kept ones."""
    done = {r["mode"] for r in rows}
    rows = [dict(r) for r in rows] + [r for r in kept if r["mode"] not in done]
    rows.sort(key=lambda r: labels.index(r["mode"]) if r["mode"] in labels else len(labels))
    base = next(r["ppl"] for r in rows if r["mode"].startswith("bf16"))
    for r in rows:
        r["vs_bf16_pct"] = 100 * (r["ppl"] / base - 1)
    RESULTS.mkdir(exist_ok=True)
    meta = {
        "tokens": num_tokens,
        "window": args.window,
        "threads": args.threads,
        "when": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
        **provenance(),
    }
    result_path("quant_perplexity", "json").write_text(json.dumps({"meta": meta, "rows": rows}, indent=2) + "\n")
    lines = [
        "# Perplexity by quantization mode (default model, SmolLM2-135M-Instruct)",
        "",
        stamp(meta),
        "",
        f"{meta['tokens']} tokens of *Coriolanus* (benchmarks/data/coriolanus_act1.txt), windows of "
        f"{args.window} tokens, {meta['when']}.",
        "",
        "| mode | perplexity | vs bf16 |",
        "| --- | --- | --- |",
    ]
    lines += [f"| {r['mode']} | {r['ppl']:.3f} | {r['vs_bf16_pct']:+.2f} % |" for r in rows]
    result_path("quant_perplexity", "md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--window", type=int, default=1024)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument(
        "--only",
        default="",
        help="'|'-separated mode labels (or label prefixes) to rerun; "
        "the other rows, bf16 included, are kept from the last results file",
    )
    args = ap.parse_args()
    only = [o.strip() for o in args.only.split("|") if o.strip()]
    old = result_path("quant_perplexity", "json")
    kept = json.loads(old.read_text())["rows"] if only and old.exists() else []
    plain = default_model_dir()
    text = TEXT.read_text()
    common = dict(num_kv_blocks=args.window // 16 + 1, max_model_len=args.window, num_threads=args.threads)
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        q41 = Path(tmp) / "q41"
        cases = [
            ("float32 (reference)", plain, dict(dtype="float32")),
            ("bf16 (`none`)", plain, dict(dtype="bfloat16", quantization="none")),
            ("int8", plain, dict(dtype="bfloat16", quantization="int8")),
            ("int4 g32", plain, dict(dtype="bfloat16", quantization="int4", quant_group_size=32)),
            ("int4 g64", plain, dict(dtype="bfloat16", quantization="int4", quant_group_size=64)),
            ("w8a8", plain, dict(dtype="bfloat16", quantization="w8a8")),
            (
                "int8, prefill in 64-token chunks (batched-decode row count: `torch._int_mm`)",
                plain,
                dict(dtype="bfloat16", quantization="int8", chunk=64),
            ),
            ("Q4_1 GGUF served natively (int4 g32)", q41, dict(dtype="bfloat16")),
            (
                "fp8 KV (`kv_cache_dtype: fp8_e4m3`, bf16 weights)",
                plain,
                dict(dtype="bfloat16", kv_cache_dtype="fp8_e4m3"),
            ),
            ("int8 KV (`kv_cache_dtype: int8`, bf16 weights)", plain, dict(dtype="bfloat16", kv_cache_dtype="int8")),
        ]
        tokens = None
        labels = [label for label, _, _ in cases]
        if only:
            cases = [c for c in cases if any(c[0].startswith(o) for o in only)]
        if any(model == q41 for _, model, _ in cases):
            convert_gguf_quantized(default_gguf_path(), q41)
        for label, model, opts in cases:
            t0 = time.perf_counter()
            opts = dict(opts)
            chunk = opts.pop("chunk", 0)
            llm = LLM(model, **common, **opts)
            tokens = tokens or llm.tokenizer.encode(text, add_special_tokens=False)
            ppl = perplexity(llm, tokens, args.window, chunk)
            rows.append({"mode": label, "ppl": ppl, "seconds": time.perf_counter() - t0})
            print(f"{label:40s} ppl {ppl:.4f}", flush=True)
            del llm
            write_results(rows, kept, labels, len(tokens), args)  # after each mode: a stopped run keeps its rows


if __name__ == "__main__":
    main()
