"""How many long sequences one KV budget holds with the hybrid KV cache and without, for the
real Gemma 3 270M shape (18 layers, 15 sliding with a 512-token window, 3 full; 1 KV head of
256), by the engine's own sizing: `kv_pool_size` (blocks in the budget, a block being a page of
the layout's shared tensors) and `KVCacheLayout.blocks_for_one_sequence` (blocks a decoding
sequence holds: every block of a full group, the window's of a sliding one).

The shape is read from the config.json pagedserve wrote when it converted the installed GGUF
(`~/.cache/pagedserve/from-path/*/gemma-3-270m-q4_k_m/config.json`), or from `--config`.
The engine-level check of the same rule (a tiny Gemma 3 through the scheduler, 10 sequences of
4,096 tokens resident in 6 MiB against 1 without) is tests/engine/kv_cache/test_hybrid_engine.py.

    python benchmarks/hybrid_kv_capacity.py [--config PATH] [--budget 1GiB]
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from benchmarks._common import provenance, result_path, stamp
from pagedserve.engine.attention.kv_dtype import KVCacheDtype
from pagedserve.engine.config.engine import EngineConfig
from pagedserve.engine.model.kv_pool_size import kv_layout, kv_pool_size
from pagedserve.engine.model.registry import parse_config

CONTEXTS = (4096, 8192, 32768)


def _default_config() -> Path:
    found = sorted(Path.home().glob(".cache/pagedserve/from-path/*/gemma-3-270m-q4_k_m/config.json"))
    if not found:
        raise SystemExit("no converted Gemma 3 270M found: register the GGUF once, or pass --config")
    return found[0]


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--config", type=Path, default=None)
    parser.add_argument("--budget", default="1GiB")
    parser.add_argument("--dtype", default="bfloat16")
    args = parser.parse_args()
    path = args.config or _default_config()
    spec = parse_config(json.loads(path.read_text()))
    rows = []
    for context in CONTEXTS:
        row = {"context": context}
        for hybrid in (True, False):
            config = EngineConfig(
                model=str(path.parent), dtype=args.dtype, kv_cache_memory=args.budget, hybrid_kv_cache=hybrid
            )
            layout = kv_layout(config, spec)
            per_block, blocks = kv_pool_size(config, spec, KVCacheDtype.AUTO)
            per_seq = layout.blocks_for_one_sequence(context, config.block_size, 1)
            row["hybrid" if hybrid else "plain"] = {
                "groups": len(layout.groups),
                "layers_per_block": layout.num_tensors,
                "bytes_per_block": per_block,
                "blocks": blocks,
                "blocks_per_sequence": per_seq,
                "sequences": blocks // per_seq,
            }
        row["ratio"] = row["hybrid"]["sequences"] / max(1, row["plain"]["sequences"])
        rows.append(row)
    result = {**provenance(), "config": str(path), "budget": args.budget, "rows": rows}
    result_path("hybrid_kv_capacity", "json").write_text(json.dumps(result, indent=2))
    lines = [
        "# Hybrid KV cache: long sequences per KV budget (Gemma 3 270M shape)",
        "",
        stamp(result),
        "",
        f"Budget {args.budget} of {args.dtype} KV, block size 16, decoding sequences (between steps).",
        "Counted by the engine's sizing code (no timing; the CPU does not matter).",
        "",
        "| context | hybrid: groups x layers/block | blocks | blocks/seq | sequences | plain: blocks | blocks/seq | sequences | ratio |",
        "| ---: | --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: |",
    ]
    for r in rows:
        h, p = r["hybrid"], r["plain"]
        lines.append(
            f"| {r['context']:,} | {h['groups']} x {h['layers_per_block']} | {h['blocks']:,} | {h['blocks_per_sequence']:,}"
            f" | {h['sequences']} | {p['blocks']:,} | {p['blocks_per_sequence']:,} | {p['sequences']} | {r['ratio']:.2f}x |"
        )
    text = "\n".join(lines) + "\n"
    result_path("hybrid_kv_capacity", "md").write_text(text)
    print(text)


if __name__ == "__main__":
    main()
