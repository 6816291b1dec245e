"""LoRA throughput: a batch mixing 4 adapters vs the same batch with no adapter, and the time to
register an adapter, on the default model (bfloat16, the serving dtype).

One engine (max_loras=4) runs both batches: the same prompts, the same lengths, greedy with
ignore_eos, so both produce exactly the same number of tokens; only the adapters differ (each of
the 4 adapters takes a quarter of the rows, rank 16, all seven projections). The two batches
alternate for `--rounds` paired rounds, the order flipping every round; the reported ratio is
the median of the per-round ratios (mixed tok/s / plain tok/s). Peak RSS of the process.

Registering an adapter is timed as the server does it (pagedserve.engine.model.lora_archive + pagedserve.server.workers.adapters):
archive the adapter (`write_lora_archive`), open and verify the archive (`load_archive`), read
and check its factors against the base (`load_adapter`), and, in the worker, its first load
into a slot. Adapters are random PEFT folders written here (adapter_config.json +
adapter_model.safetensors), so nothing is downloaded.

    .venv/bin/python benchmarks/lora.py [--rounds 5] [--batch 16] [--prompt-len 64] [--max-tokens 32] [--threads 1]

Results go to benchmarks/results/lora.<cpu-kind>.{json,md}.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time
from pathlib import Path

from _common import RESULTS, make_prompts, peak_rss_mib, result_path

from pagedserve.server.commands.bench.harness import provenance, run_paired, stamp

REPO = Path(__file__).resolve().parent.parent
TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]


def write_adapter(folder: Path, spec, rank: int, seed: int) -> Path:
    """A random PEFT LoRA folder for the model `spec` (all seven projections)."""
    import torch
    from safetensors.torch import save_file

    from pagedserve.engine.lora.adapter import lora_shapes

    shapes = lora_shapes(spec)
    g = torch.Generator().manual_seed(seed)
    tensors = {}
    for layer in range(spec.num_layers):
        for target in TARGETS:
            fan_in, fan_out = shapes.in_out(target)
            part = "self_attn" if target.endswith(("q_proj", "k_proj", "v_proj", "o_proj")) else "mlp"
            prefix = f"base_model.model.model.layers.{layer}.{part}.{target}"
            tensors[f"{prefix}.lora_A.weight"] = torch.randn(rank, fan_in, generator=g) * 0.02
            tensors[f"{prefix}.lora_B.weight"] = torch.randn(fan_out, rank, generator=g) * 0.02
    folder.mkdir(parents=True)
    save_file(tensors, str(folder / "adapter_model.safetensors"))
    (folder / "adapter_config.json").write_text(
        json.dumps({"peft_type": "LORA", "r": rank, "lora_alpha": 2 * rank, "target_modules": TARGETS, "bias": "none"})
    )
    return folder


def time_registration(model_dir: Path, spec, tmp: Path, rank: int) -> dict:
    """Seconds for each step of registering one adapter on the server, and its first slot load."""
    from pagedserve.engine.lora.adapter import load_adapter, lora_shapes
    from pagedserve.engine.lora.slots import LoRASlots
    from pagedserve.engine.model.archive_write import write_archive
    from pagedserve.engine.model.lora_archive import write_lora_archive
    from pagedserve.server.workers.archives import load_archive

    store = tmp / "store"
    write_archive(model_dir, store, model_name="base", version="1.0", archive_format="no-archive")
    adapter_dir = write_adapter(tmp / "reg-adapter", spec, rank, seed=99)
    t0 = time.perf_counter()
    path = write_lora_archive(
        adapter_dir, store, model_name="reg", version="1.0", base_model="base", base_version=None, model_store=store
    )
    t1 = time.perf_counter()
    archive = load_archive(path, allow_custom_handlers=False)
    t2 = time.perf_counter()
    adapter = load_adapter("reg", archive.model_dir, lora_shapes(spec), rank)
    t3 = time.perf_counter()
    import torch

    slots = LoRASlots(lora_shapes(spec), 4, rank, torch.bfloat16, torch.device("cpu"))
    slots.activate([adapter])  # allocates the slots too (the first adapter a worker sees)
    t4 = time.perf_counter()
    slots.activate([load_adapter("reg2", adapter_dir, lora_shapes(spec), rank)])  # a second one: a copy only
    t5 = time.perf_counter()
    return {
        "archive_s": t1 - t0,
        "open_verify_s": t2 - t1,
        "load_check_s": t3 - t2,
        "register_total_s": t3 - t1,
        "first_slot_load_s": t4 - t3,
        "next_slot_load_s": t5 - t4,
        "adapter_mib": (adapter_dir / "adapter_model.safetensors").stat().st_size / 2**20,
    }


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--batch", type=int, default=16)
    parser.add_argument("--prompt-len", type=int, default=64)
    parser.add_argument("--max-tokens", type=int, default=32)
    parser.add_argument("--rank", type=int, default=16)
    parser.add_argument(
        "--threads", type=int, default=1, help="torch threads (1: on a shared machine two threads wait on each other)"
    )
    args = parser.parse_args()
    sys.path.insert(0, str(REPO))
    from pagedserve.engine import LLM, LoRARequest, SamplingParams
    from pagedserve.engine.model.default_model import default_model_dir

    tmp = Path(tempfile.mkdtemp(prefix="pagedserve-lora-bench-"))
    llm = LLM(
        default_model_dir(),
        dtype="bfloat16",
        kv_cache_memory="512MiB",
        max_model_len=1024,
        num_threads=args.threads,
        max_loras=4,
        max_lora_rank=args.rank,
        enable_prefix_caching=False,
    )
    spec = llm.engine.runner.model.spec
    adapters = [LoRARequest(f"a{i}", str(write_adapter(tmp / f"a{i}", spec, args.rank, seed=i))) for i in range(4)]
    prompts = make_prompts(llm.tokenizer, args.batch, args.prompt_len, seed=0)
    mixed = [adapters[i % 4] for i in range(args.batch)]
    params = SamplingParams(max_tokens=args.max_tokens, temperature=0, ignore_eos=True)
    llm.generate(prompts[:4], SamplingParams(max_tokens=4), lora=adapters)  # warm-up: loads the 4 slots

    def run(lora) -> float:
        start = time.perf_counter()
        outs = llm.generate(prompts, params, lora=lora)
        elapsed = time.perf_counter() - start
        assert sum(len(o.outputs[0].token_ids) for o in outs) == args.batch * args.max_tokens
        return args.batch * args.max_tokens / elapsed

    paired = run_paired(
        "plain",
        "mixed",
        lambda side: {"tok_per_s": run(None if side == "plain" else mixed)},
        metric="tok_per_s",
        rounds=args.rounds,
        log=lambda line: print(line, file=sys.stderr),
    )
    rounds = [
        {"order": list(order), "plain_tok_per_s": p["tok_per_s"], "mixed_tok_per_s": m["tok_per_s"], "ratio": ratio}
        for order, p, m, ratio in zip(paired.orders, paired.runs["plain"], paired.runs["mixed"], paired.ratios)
    ]
    registration = time_registration(default_model_dir(), spec, tmp, args.rank)
    import shutil

    shutil.rmtree(tmp, ignore_errors=True)
    ratios = paired.ratios
    result = {
        "what": "tok/s of a batch mixing 4 LoRA adapters vs the same batch with none (same engine, bf16)",
        **provenance(paired.loads),
        "threads": args.threads,
        "batch": args.batch,
        "prompt_len": args.prompt_len,
        "max_tokens": args.max_tokens,
        "rank": args.rank,
        "rounds": rounds,
        "median_ratio": paired.ratio_median,
        "min_ratio": min(ratios),
        "target_ratio": 0.75,
        "peak_rss_mib": peak_rss_mib(),
        "registration": registration,
    }
    RESULTS.mkdir(exist_ok=True)
    result_path("lora", "json").write_text(json.dumps(result, indent=2) + "\n")
    lines = [
        "# LoRA: mixed-adapter batch vs no adapter",
        "",
        stamp(result),
        "",
        f"Default model, bf16, {args.threads} torch thread(s), batch {args.batch} x {args.prompt_len} prompt tokens, {args.max_tokens} output "
        f"tokens each, 4 adapters of rank {args.rank} on all seven projections (a quarter of the rows each). "
        f"Load average when it ended: {os.getloadavg()[0]:.1f} on {os.cpu_count()} cores "
        "(on a busy machine only the ratios mean something).",
        "",
        "| round | order | plain tok/s | mixed tok/s | ratio |",
        "| --- | --- | --- | --- | --- |",
        *[
            f"| {i} | {' then '.join(r['order'])} | {r['plain_tok_per_s']:.1f} | {r['mixed_tok_per_s']:.1f} | "
            f"{r['ratio']:.3f} |"
            for i, r in enumerate(rounds)
        ],
        "",
        f"**Median ratio {result['median_ratio']:.3f}** (target >= 0.75; lowest round {result['min_ratio']:.3f}). "
        f"Peak RSS {result['peak_rss_mib']:.0f} MiB.",
        "",
        "Registering one adapter ({adapter_mib:.1f} MiB of factors): archive {archive_s:.3f} s; open and verify "
        "{open_verify_s:.3f} s + read and check against the base {load_check_s:.3f} s = **{register_total_s:.3f} s** "
        "(what POST /models costs besides the HTTP round trip); first load into a worker's slots "
        "{first_slot_load_s:.3f} s (allocates the slots), a later one {next_slot_load_s:.3f} s.".format(**registration),
    ]
    result_path("lora", "md").write_text("\n".join(lines) + "\n")
    print(json.dumps({"median_ratio": result["median_ratio"], "registration": registration}))


if __name__ == "__main__":
    main()
