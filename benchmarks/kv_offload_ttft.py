"""KV offload: time to first token of a 2,000-token prompt, cold vs restored, in one run.

Three cases, bfloat16, the default model, one torch thread by default (`--threads`): on the
shared 2-core machine two threads oversubscribed the cores and made both prefill and the KV
copies several times slower and erratic:

- cold: nothing cached anywhere (offload on: its stores are part of the cost);
- CPU tier: the same prompt after the engine's own block pool was emptied by other prompts, so
  its prefix comes back from LMCache's CPU memory;
- disk: a new process (a "restarted server") on the same disk folder; the prompt's prefix comes
  back from disk. Measured twice: with the chunk files still in the OS page cache (as right after
  a restart) and after dropping just those files from the page cache (posix_fadvise DONTNEED),
  which reads them from the device.

A restore covers the prompt but its last block (the last token must be computed). The run covers
the default chunk_size 256 and 128. Each phase runs in a fresh child process (its own peak RSS);
each case reports the median over its prompts and the median ratio of paired measurements (the
harness's PairedRounds; a prompt is cold before it is restored, so the order within a pair is fixed).
Results go to benchmarks/results/kv_offload_ttft.<cpu-kind>.{json,md}.

    .venv/bin/python benchmarks/kv_offload_ttft.py [--prompt-len 2000] [--trials 3]
"""

from __future__ import annotations

import argparse
import json
import os
import random
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path

from _common import RESULTS, peak_rss_mib, result_path, run_phase

from pagedserve.server.commands.bench.harness import PairedRounds, provenance, stamp

BLOCK = 16


def make_prompt(tokenizer, length: int, seed: int) -> list[int]:
    rng = random.Random(seed)
    # Sorted: get_vocab()'s order differs between processes, and the restart phase (a new
    # process) must rebuild exactly the prompts the first phase stored.
    words = sorted(w for w in tokenizer.get_vocab() if w.isalpha() and len(w) > 3)[:5000]
    text = " ".join(rng.choice(words) for _ in range(length * 2))
    return tokenizer.encode(text, add_special_tokens=False)[:length]


def make_llm(args, disk: str):
    from pagedserve.engine import LLM

    pool_tokens = (args.prompt_len // BLOCK + 8) * BLOCK
    return LLM(
        args.model,
        dtype="bfloat16",
        num_threads=args.threads,
        num_kv_blocks=pool_tokens // BLOCK,
        max_model_len=pool_tokens,
        max_num_batched_tokens=pool_tokens,
        kv_offload={"cpu_size_gb": 1, "disk_path": disk, "disk_size_gb": 4, "chunk_size": args.chunk_size},
    )


def ttft(llm, ids) -> float:
    from pagedserve.engine import SamplingParams

    start = time.perf_counter()
    llm.generate([ids], SamplingParams(max_tokens=1, temperature=0))
    return time.perf_counter() - start


def evict_pool(llm, tokenizer, args, seed: int) -> None:
    """Fill the whole block pool with another prompt: no block of an earlier prompt survives."""
    engine = llm.engine
    filler = make_prompt(tokenizer, engine.max_model_len - 1, seed)
    ttft(llm, filler)
    assert engine.kv_manager.pool.get_num_free_blocks() == engine.runner.num_blocks


def phase_first(args, tokenizer) -> dict:
    """Cold, then CPU-tier hits after the engine pool was emptied; leaves chunks on disk."""
    llm = make_llm(args, args.disk)
    ttft(llm, make_prompt(tokenizer, 64, seed=1))  # warm-up
    cold, cpu = [], []
    for trial in range(2 * args.trials):  # twice as many prompts: the restart phase reads each once
        ids = make_prompt(tokenizer, args.prompt_len, seed=100 + trial)
        cold.append(ttft(llm, ids))
        evict_pool(llm, tokenizer, args, seed=200 + trial)
        before = llm.engine.kv_offload_stats()["hit_tokens_cpu"]
        cpu.append(ttft(llm, ids))
        restored = llm.engine.kv_offload_stats()["hit_tokens_cpu"] - before
    assert llm.engine.kv_offload.flush(timeout=120)
    stats = llm.engine.kv_offload_stats()
    llm.shutdown()
    return {
        "cold_s": cold,
        "cpu_hit_s": cpu,
        "restored_tokens": restored,
        "stats": stats,
        "peak_rss_mib": peak_rss_mib(),
    }


def _drop_from_page_cache(folder: str) -> int:
    n = 0
    for path in Path(folder).glob("*.data"):
        fd = os.open(path, os.O_RDONLY)
        try:
            os.fsync(fd)
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
            n += 1
        finally:
            os.close(fd)
    return n


def phase_restart(args, tokenizer) -> dict:
    """A new process on the same folder: disk hits (page cache warm, then dropped), and cold."""
    llm = make_llm(args, args.disk)
    ttft(llm, make_prompt(tokenizer, 64, seed=1))  # warm-up
    warm, dropped, cold = [], [], []
    for trial in range(2 * args.trials):
        ids = make_prompt(tokenizer, args.prompt_len, seed=100 + trial)
        if trial % 2 == 0:  # alternate the two disk cases over the prompts written by phase_first
            warm.append(ttft(llm, ids))
        else:
            _drop_from_page_cache(args.disk)
            dropped.append(ttft(llm, ids))
        evict_pool(llm, tokenizer, args, seed=300 + trial)
        # A cold prompt right after each disk hit: the machine is shared, so each restored
        # measurement is paired with a cold one taken next to it.
        cold.append(ttft(llm, make_prompt(tokenizer, args.prompt_len, seed=400 + trial)))
        evict_pool(llm, tokenizer, args, seed=500 + trial)
    stats = llm.engine.kv_offload_stats()
    llm.shutdown()
    return {
        "disk_hit_s": warm,
        "disk_hit_dropped_s": dropped,
        "cold_s": cold,
        "stats": stats,
        "peak_rss_mib": peak_rss_mib(),
    }


def run_child(args, phase: str, disk: str, chunk_size: int) -> dict:
    result = run_phase(
        __file__,
        [
            "--phase",
            phase,
            "--model",
            args.model,
            "--disk",
            disk,
            "--prompt-len",
            str(args.prompt_len),
            "--trials",
            str(args.trials),
            "--chunk-size",
            str(chunk_size),
            "--threads",
            str(args.threads),
        ],
    )
    print(f"  chunk {chunk_size} {phase}: " + json.dumps({k: v for k, v in result.items() if k != "stats"}), flush=True)
    return result


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--model", default=None)
    parser.add_argument("--prompt-len", type=int, default=2000)
    parser.add_argument("--trials", type=int, default=3)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--chunk-sizes", default="256,128")
    parser.add_argument("--chunk-size", type=int, default=256, help=argparse.SUPPRESS)
    parser.add_argument("--phase", default=None, help=argparse.SUPPRESS)
    parser.add_argument("--disk", default=None, help=argparse.SUPPRESS)
    parser.add_argument("--render", action="store_true", help="rewrite the .md from the latest .json")
    args = parser.parse_args()
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
    if args.model is None:
        from pagedserve.engine.model.default_model import default_model_dir

        args.model = str(default_model_dir())
    if args.phase:
        from transformers import AutoTokenizer

        tokenizer = AutoTokenizer.from_pretrained(args.model)
        result = {"first": phase_first, "restart": phase_restart}[args.phase](args, tokenizer)
        print(json.dumps(result))
        return

    if args.render:
        summary = json.loads(result_path("kv_offload_ttft", "json").read_text())
        for row in summary["by_chunk_size"].values():
            row.update(summarize(row["runs"]["first"], row["runs"]["restart"]))
    else:
        summary = {
            "workload": {
                "prompt_len": args.prompt_len,
                "dtype": "bfloat16",
                "threads": args.threads,
                "trials": args.trials,
                "cpu_size_gb": 1,
                "disk_size_gb": 4,
            },
            **provenance(),
            "date": time.strftime("%Y-%m-%d %H:%M"),
            "by_chunk_size": {},
        }
        for chunk_size in (int(c) for c in args.chunk_sizes.split(",")):
            disk = tempfile.mkdtemp(prefix=f"kv_offload_bench_{chunk_size}_")
            try:
                first = run_child(args, "first", disk, chunk_size)
                restart = run_child(args, "restart", disk, chunk_size)
            finally:
                shutil.rmtree(disk, ignore_errors=True)
            runs = {
                "first": {k: v for k, v in first.items() if k != "stats"},
                "restart": {k: v for k, v in restart.items() if k != "stats"},
            }
            summary["by_chunk_size"][str(chunk_size)] = {
                **summarize(runs["first"], runs["restart"]),
                "offload_stats": {"first": first["stats"], "restart": restart["stats"]},
                "runs": runs,
            }
        RESULTS.mkdir(exist_ok=True)
        result_path("kv_offload_ttft", "json").write_text(json.dumps(summary, indent=2) + "\n")
    md = render(summary)
    result_path("kv_offload_ttft", "md").write_text(md)
    print(md)


def summarize(first: dict, restart: dict) -> dict:
    """Median TTFT per case, cold / restored ratios of the medians, and the median of the ratios
    of measurement pairs taken next to each other (the most robust on a busy machine)."""
    cases = {
        "cold": first["cold_s"] + restart["cold_s"],
        "cpu": first["cpu_hit_s"],
        "disk": restart["disk_hit_s"],
        "disk_dropped": restart["disk_hit_dropped_s"],
    }
    out = {
        "restored_tokens": first["restored_tokens"],
        "peak_rss_mib": {"first": first["peak_rss_mib"], "restart": restart["peak_rss_mib"]},
    }
    values = {case: statistics.median(v) for case, v in cases.items() if v}
    out["median"] = {
        "ttft_s": values,
        "speedup": {case: values["cold"] / v for case, v in values.items() if case != "cold"},
    }
    restart_cold = restart["cold_s"]
    if len(restart_cold) == len(restart["disk_hit_s"]) + len(restart["disk_hit_dropped_s"]):
        pairs = {
            "cpu": (first["cold_s"], first["cpu_hit_s"]),
            "disk": (restart_cold[0::2], restart["disk_hit_s"]),
            "disk_dropped": (restart_cold[1::2], restart["disk_hit_dropped_s"]),
        }
        out["paired_speedup_median"] = {
            case: paired(cold, hit).ratio_median for case, (cold, hit) in pairs.items() if hit
        }
    return out


def paired(cold: list[float], restored: list[float]) -> PairedRounds:
    """The harness's paired rounds over TTFTs taken next to each other (a prompt must be cold
    before it can be restored, so here the order within a pair is fixed): cold / restored."""
    return PairedRounds(
        "restored",
        "cold",
        "ttft_s",
        runs={"restored": [{"ttft_s": t} for t in restored], "cold": [{"ttft_s": t} for t in cold[: len(restored)]]},
    )


def render(summary: dict) -> str:
    w = summary["workload"]
    md = [
        "# KV offload: time to first token (latest run)",
        "",
        stamp(summary),
        "",
        (
            f"A {w['prompt_len']}-token prompt, bf16, {w['threads']} torch thread, the default model. Cold = "
            "nothing cached; CPU tier = the same prompt after the engine's block pool was emptied by other "
            "prompts; disk = a new process on the same folder, with the chunk files in the OS page cache (as "
            "right after a restart) and dropped from it with posix_fadvise (read from the device). "
            f"{2 * w['trials']} prompts per phase; cells show the median TTFT with the cold / restored "
            "ratios, and (bold) the median ratio of pairs measured next to each other: a restored prompt and "
            "the cold prompt run just before (CPU tier) or just after it (disk)."
        ),
        "",
        (
            "| chunk_size | restored tokens | cold | CPU tier | disk (page cache) | disk (dropped from page cache) "
            "| peak RSS first / restart |"
        ),
        "| --- | --- | --- | --- | --- | --- | --- |",
    ]

    def cell(row, case):
        t = row["median"]["ttft_s"].get(case)
        if t is None:
            return "n/a"
        ratio = row["median"]["speedup"].get(case)
        paired = row.get("paired_speedup_median", {}).get(case)
        return (
            f"{1000 * t:.0f} ms"
            + (f" ({ratio:.1f}x)" if ratio else "")
            + (f"; paired **{paired:.1f}x**" if paired else "")
        )

    for chunk_size, row in summary["by_chunk_size"].items():
        md.append(
            f"| {chunk_size} | {row['restored_tokens']} of {w['prompt_len']} | {cell(row, 'cold')} | "
            f"{cell(row, 'cpu')} | {cell(row, 'disk')} | {cell(row, 'disk_dropped')} | "
            f"{row['peak_rss_mib']['first']:.0f} / {row['peak_rss_mib']['restart']:.0f} MiB |"
        )
    md += [
        "",
        (
            "Restored TTFT includes computing the prompt's last block (LMCache holds whole blocks and at "
            "least the last token is computed) and the lookup; cold TTFT includes storing the new chunks. "
            "Peak RSS includes the model, the KV pool and the part of the 1 GB CPU tier that was touched."
        ),
        "",
        f"Run on {summary['date']} (absolute times are noisy on a shared machine; ratios are taken within one run).",
    ]
    return "\n".join(md) + "\n"


if __name__ == "__main__":
    main()
