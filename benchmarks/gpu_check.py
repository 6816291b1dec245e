"""One-command GPU check (issue 14): what only a CUDA device can show, in under 5 minutes.

1. The Triton paged-attention kernel against its plain-torch reference on the GPU, compiled
   (not the interpreter the CPU tests use): bf16, fp16 and fp32, decodes, prefills and prefill
   chunks mixed in one launch, SmolLM2's heads (9 / 3, dim 64) and a larger layout (32 / 8, 128).
2. The default model end to end on CUDA: greedy parity with transformers on the same device
   (float32, token for token, plain and chat prompts), and bf16 answers that must hold
   ("1, 2, 3, 4," -> " 5, 6, 7"; "What is 2 plus 2?" -> "4").
3. KV offload GPU -> CPU -> disk: a prompt's KV stored through LMCache, the pool emptied, restored
   from the CPU tier, then in a new engine (empty CPU tier) from disk; the restored KV must equal
   the computed KV bit for bit and the greedy output must not change.
4. The paged-attention kernel's achieved memory bandwidth at decode (bytes of K/V read per
   second) against the device's peak (from its memory clock and bus width) and against a plain
   device-to-device copy measured here.

Each check prints PASS or FAIL with its numbers; results go to benchmarks/results/gpu_check.<cpu-kind>.{json,md}
and the exit status is 1 if any check failed. Without a CUDA device it says so and exits 0
(nothing is written). `--dry-run-on-cpu` runs checks 1-3 on the CPU (Triton's interpreter, small
layouts, nothing written), to test the script itself where no GPU is lent.

    .venv/bin/python benchmarks/gpu_check.py [--dry-run-on-cpu]
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time
import traceback
from pathlib import Path
from statistics import median

from _common import RESULTS, provenance, result_path, stamp

REPO = Path(__file__).resolve().parent.parent
BLOCK = 16


def random_batch(torch, *, query_lens, seq_lens, heads, kv_heads, dim, dtype, device="cuda", num_blocks=None):
    """Random query and paged K/V caches for sequences with these query / context lengths."""
    blocks_per_seq = [-(-s // BLOCK) for s in seq_lens]
    total = num_blocks or sum(blocks_per_seq) + 8
    perm = torch.randperm(total, device=device).to(torch.int32)
    tables = torch.zeros(len(seq_lens), max(blocks_per_seq), dtype=torch.int32, device=device)
    used = 0
    for i, n in enumerate(blocks_per_seq):
        tables[i, :n] = perm[used : used + n]
        used += n
    starts = [0]
    for q in query_lens:
        starts.append(starts[-1] + q)
    return {
        "query": torch.randn(starts[-1], heads, dim, device=device, dtype=dtype),
        "key_cache": torch.randn(total, BLOCK, kv_heads, dim, device=device, dtype=dtype),
        "value_cache": torch.randn(total, BLOCK, kv_heads, dim, device=device, dtype=dtype),
        "block_tables": tables,
        "seq_lens": torch.tensor(seq_lens, dtype=torch.int32, device=device),
        "query_start_loc": torch.tensor(starts, dtype=torch.int32, device=device),
    }


def check_triton(device: str) -> dict:
    import torch

    from pagedserve.kernels.triton_paged_attention import paged_attention, paged_attention_reference

    tolerances = {torch.bfloat16: 2e-2, torch.float16: 2e-3, torch.float32: 1e-4}
    # (query_lens, seq_lens): decodes, a prefill, prefill chunks over a longer context, mixed
    layouts = [
        ([1] * 8, [17, 100, 256, 1, 33, 500, 64, 1024]),
        ([37, 1, 128, 5, 1], [37, 300, 1000, 5, 16]),
        ([250], [250]),
        ([64, 1, 1], [1500, 2048, 1]),
    ]
    if device == "cpu":  # the dry run: Triton's interpreter, about a second per launch
        layouts, tolerances = [([1, 1, 1], [17, 40, 1]), ([5, 1], [37, 20])], {torch.bfloat16: 2e-2}
    rows, ok = [], True
    for heads, kv_heads, dim in ((9, 3, 64), (32, 8, 128)):
        for dtype, tol in tolerances.items():
            worst, max_abs = float("-inf"), 0.0
            for query_lens, seq_lens in layouts:
                batch = random_batch(
                    torch,
                    query_lens=query_lens,
                    seq_lens=seq_lens,
                    heads=heads,
                    kv_heads=kv_heads,
                    dim=dim,
                    dtype=dtype,
                    device=device,
                )
                got = paged_attention(**batch, max_query_len=max(query_lens), scale=dim**-0.5)
                ref = paged_attention_reference(**batch, scale=dim**-0.5)
                # assert_close's rule with atol = rtol = tol, as tests/kernels uses in the interpreter
                diff = (got.float() - ref.float()).abs()
                worst = max(worst, (diff - tol * ref.float().abs()).max().item())
                max_abs = max(max_abs, diff.max().item())
            passed = worst <= tol
            ok &= passed
            rows.append(
                {
                    "heads": f"{heads}/{kv_heads}x{dim}",
                    "dtype": str(dtype).removeprefix("torch."),
                    "max_abs_err": max_abs,
                    "max_err_beyond_rtol": worst,
                    "tolerance": tol,
                    "pass": passed,
                }
            )
            print(f"  {rows[-1]}", flush=True)
    return {"pass": ok, "cases": rows}


def _hf_greedy(model, prompts, max_new, device):
    import torch

    outs = []
    with torch.inference_mode():
        for p in prompts:
            ids = torch.tensor([p], device=device)
            gen = model.generate(
                ids, attention_mask=torch.ones_like(ids), max_new_tokens=max_new, do_sample=False, pad_token_id=2
            )
            outs.append(gen[0, len(p) :].tolist())
    return outs


def check_parity(device: str) -> dict:
    import torch
    from transformers import AutoModelForCausalLM

    from pagedserve.engine import LLM, SamplingParams
    from pagedserve.engine.model.default_model import default_model_dir
    from pagedserve.engine.model.tokenizer import load_tokenizer

    model_dir = default_model_dir()
    tok = load_tokenizer(model_dir)

    def chat(text):
        return tok.encode(
            tok.apply_chat_template([{"role": "user", "content": text}], tokenize=False, add_generation_prompt=True),
            add_special_tokens=False,
        )

    long_text = "Inventory list.\n" + "\n".join(f"Item {i}: a basket holds {i % 7 + 2} apples." for i in range(80))
    prompts = [
        tok.encode("1, 2, 3, 4,", add_special_tokens=False),
        chat("What is 2 plus 2?"),
        chat("Write a haiku about the sea."),
        tok.encode(long_text, add_special_tokens=False),
    ]
    max_new = 12
    hf = AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=torch.float32).to(device).eval()
    expected = _hf_greedy(hf, prompts, max_new, device)
    del hf
    llm = LLM(model_dir, device=device, dtype="float32", kv_cache_memory="1GiB")
    got = [o.outputs[0].token_ids for o in llm.generate(prompts, SamplingParams(max_tokens=max_new, temperature=0))]
    llm.shutdown()
    mismatches = [
        {"prompt": i, "engine": g, "transformers": e} for i, (g, e) in enumerate(zip(got, expected)) if g != e
    ]
    bf16 = LLM(model_dir, device=device, dtype="bfloat16", kv_cache_memory="1GiB")
    texts = [o.outputs[0].text for o in bf16.generate(prompts[:2], SamplingParams(max_tokens=32, temperature=0))]
    bf16.shutdown()
    bf16_ok = texts[0].startswith(" 5, 6, 7") and "4" in texts[1]
    print(f"  float32 mismatches: {len(mismatches)} of {len(prompts)}; bf16 answers {texts!r}", flush=True)
    return {
        "pass": not mismatches and bf16_ok,
        "float32_prompts": len(prompts),
        "float32_mismatches": mismatches,
        "bf16_answers": texts,
        "bf16_pass": bf16_ok,
    }


def check_offload(device: str) -> dict:
    import torch

    from pagedserve.engine import LLM, SamplingParams
    from pagedserve.engine.model.default_model import default_model_dir
    from pagedserve.engine.model.tokenizer import load_tokenizer
    from pagedserve.engine.request.request import Request

    model_dir = default_model_dir()
    tok = load_tokenizer(model_dir)
    text = "Inventory list.\n" + "\n".join(f"Item {i}: a basket holds {i % 7 + 2} pears." for i in range(16))
    prompt = tok.encode(text, add_special_tokens=False)
    num_blocks, chunk = 40, 64
    full = (len(prompt) - 1) // BLOCK * BLOCK
    greedy = SamplingParams(temperature=0, max_tokens=6)

    def make(folder):
        return LLM(
            model_dir,
            device=device,
            dtype="bfloat16",
            num_kv_blocks=num_blocks,
            max_model_len=num_blocks * BLOCK,
            max_num_batched_tokens=num_blocks * BLOCK,
            kv_offload={"cpu_size_gb": 0.2, "chunk_size": chunk, "disk_path": str(folder), "disk_size_gb": 0.5},
        )

    def pool_kv(llm):
        blocks, n = llm.engine.kv_manager.get_computed_blocks(Request("probe", [*prompt, 0], SamplingParams()))
        index = torch.tensor(blocks.block_ids()[0], dtype=torch.int64, device=device)
        return [kv[:, index].clone() for kv in llm.engine.runner.kv_caches], n

    def evict(llm, seed):
        filler = [(1000 + 37 * seed + 11 * i) % 40000 + 100 for i in range(num_blocks * BLOCK - 2)]
        llm.generate([filler], SamplingParams(temperature=0, max_tokens=1))

    def same(got, ref):
        nb = full // BLOCK
        return all(torch.equal(g[:, :nb], r[:, :nb]) for g, r in zip(got, ref))

    with tempfile.TemporaryDirectory(prefix="gpu-check-kv-") as tmp:
        llm = make(Path(tmp))
        reference = llm.generate([prompt], greedy)[0].outputs[0].token_ids
        ref_kv, _ = pool_kv(llm)
        evict(llm, 0)
        from_cpu = llm.generate([prompt], greedy)[0].outputs[0].token_ids
        cpu_same = same(pool_kv(llm)[0], ref_kv)
        cpu_stats = llm.engine.kv_offload_stats()
        llm.shutdown()
        llm = make(Path(tmp))  # a new engine: its CPU tier is empty, the files are on disk
        from_disk = llm.generate([prompt], greedy)[0].outputs[0].token_ids
        disk_same = same(pool_kv(llm)[0], ref_kv)
        disk_stats = llm.engine.kv_offload_stats()
        llm.shutdown()
    result = {
        "prompt_tokens": len(prompt),
        "restorable_tokens": full,
        "cpu_tier": {
            "hit_tokens": cpu_stats["hit_tokens_cpu"],
            "kv_bit_exact": cpu_same,
            "same_output": from_cpu == reference,
            "faults": cpu_stats["faults"],
        },
        "disk_tier": {
            "hit_tokens": disk_stats["hit_tokens_disk"],
            "kv_bit_exact": disk_same,
            "same_output": from_disk == reference,
            "faults": disk_stats["faults"],
        },
    }
    result["pass"] = (
        cpu_stats["hit_tokens_cpu"] >= full
        and disk_stats["hit_tokens_disk"] >= full
        and cpu_same
        and disk_same
        and from_cpu == reference == from_disk
        and cpu_stats["faults"] == 0 == disk_stats["faults"]
    )
    print(f"  {result}", flush=True)
    return result


def _cuda_time(fn, iters: int = 20) -> float:
    """Median seconds of `fn()` on the GPU (CUDA events), after a warm-up."""
    import torch

    fn()
    torch.cuda.synchronize()
    times = []
    for _ in range(iters):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) / 1000)
    return median(times)


def peak_bandwidth() -> float | None:
    """The device's memory bandwidth from its properties (bytes/s), None where torch hides them."""
    import torch

    props = torch.cuda.get_device_properties(0)
    clock_khz = getattr(props, "memory_clock_rate", None)
    bus_bits = getattr(props, "memory_bus_width", None)
    if not clock_khz or not bus_bits:
        return None
    return 2 * clock_khz * 1e3 * bus_bits / 8  # double data rate


def check_bandwidth(device: str) -> dict:
    import torch

    from pagedserve.kernels.triton_paged_attention import paged_attention

    copy_src = torch.empty(1 << 30, dtype=torch.uint8, device=device)
    copy_dst = torch.empty_like(copy_src)
    copy_bw = 2 * copy_src.numel() / _cuda_time(lambda: copy_dst.copy_(copy_src))  # read + write
    peak = peak_bandwidth()
    rows = []
    for heads, kv_heads, dim, num_seqs, seq_len in ((32, 8, 128, 128, 4096), (9, 3, 64, 256, 2048)):
        batch = random_batch(
            torch,
            query_lens=[1] * num_seqs,
            seq_lens=[seq_len] * num_seqs,
            heads=heads,
            kv_heads=kv_heads,
            dim=dim,
            dtype=torch.bfloat16,
            device=device,
        )
        seconds = _cuda_time(lambda b=batch, d=dim: paged_attention(**b, max_query_len=1, scale=d**-0.5))
        kv_bytes = 2 * num_seqs * seq_len * kv_heads * dim * 2  # K and V, bf16
        bw = kv_bytes / seconds
        rows.append(
            {
                "layout": f"{num_seqs} seqs x {seq_len} tokens, heads {heads}/{kv_heads}x{dim}",
                "ms": 1000 * seconds,
                "kv_read_GB": kv_bytes / 1e9,
                "achieved_GBps": bw / 1e9,
                "vs_peak": None if peak is None else bw / peak,
                "vs_copy": bw / copy_bw,
            }
        )
        print(f"  {rows[-1]}", flush=True)
    return {"pass": True, "peak_GBps": None if peak is None else peak / 1e9, "copy_GBps": copy_bw / 1e9, "decode": rows}


CHECKS = (
    ("triton kernel vs reference", check_triton),
    ("default model vs transformers", check_parity),
    ("KV offload GPU -> CPU -> disk", check_offload),
    ("paged-attention bandwidth", check_bandwidth),
)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument(
        "--dry-run-on-cpu",
        action="store_true",
        help="run checks 1-3 on the CPU (Triton's interpreter, small layouts, nothing "
        "written) to test this script itself where no GPU is lent",
    )
    args = parser.parse_args()
    if args.dry_run_on_cpu:
        os.environ["TRITON_INTERPRET"] = "1"  # before pagedserve.kernels.triton_paged_attention is imported
    sys.path.insert(0, str(REPO))
    import torch

    if args.dry_run_on_cpu:
        device, name = "cpu", "CPU (dry run)"
    elif torch.cuda.is_available():
        device, name = "cuda", torch.cuda.get_device_name(0)
    else:
        print(
            f"gpu_check: no CUDA device here (torch {torch.__version__}); nothing to check on this "
            "machine. Run it where a GPU is lent."
        )
        return 0
    print(f"gpu_check on {name} (torch {torch.__version__})", flush=True)
    results: dict = {
        "device": name,
        "torch": torch.__version__,
        "date": time.strftime("%Y-%m-%d %H:%M"),
        **provenance(),
        "checks": {},
    }
    start = time.perf_counter()
    for check_name, check in CHECKS if device == "cuda" else CHECKS[:3]:
        print(f"{check_name}:", flush=True)
        t0 = time.perf_counter()
        try:
            outcome = check(device)
        except Exception as exc:  # noqa: BLE001 -- a failed check is reported, the others still run
            outcome = {"pass": False, "error": f"{type(exc).__name__}: {exc}", "traceback": traceback.format_exc()}
            print(outcome["traceback"], flush=True)
        outcome["seconds"] = round(time.perf_counter() - t0, 1)
        results["checks"][check_name] = outcome
        print(f"{'PASS' if outcome['pass'] else 'FAIL'} {check_name} ({outcome['seconds']} s)", flush=True)
    results["seconds"] = round(time.perf_counter() - start, 1)
    if device == "cuda":
        write_results(results)
    return 0 if all(c["pass"] for c in results["checks"].values()) else 1


def write_results(results: dict) -> None:
    md = [
        f"# GPU check (latest run): {results['device']}",
        "",
        stamp(results),
        "",
        f"torch {results['torch']}, {results['date']}, {results['seconds']} s in all.",
        "",
        "| check | result | seconds |",
        "| --- | --- | --- |",
    ]
    md += [
        f"| {name} | {'PASS' if c['pass'] else 'FAIL: ' + c.get('error', 'see the json')} | {c['seconds']} |"
        for name, c in results["checks"].items()
    ]
    bw = results["checks"]["paged-attention bandwidth"]
    if "decode" in bw:
        md += [
            "",
            (
                f"Paged-attention decode bandwidth (peak {bw['peak_GBps'] or 'unknown'} GB/s, "
                f"device-to-device copy {bw['copy_GBps']:.0f} GB/s):"
            ),
            "",
            "| layout | ms | K/V read GB | GB/s | vs peak | vs copy |",
            "| --- | --- | --- | --- | --- | --- |",
        ]
        md += [
            f"| {r['layout']} | {r['ms']:.3f} | {r['kv_read_GB']:.2f} | {r['achieved_GBps']:.0f} | "
            f"{'-' if r['vs_peak'] is None else format(r['vs_peak'], '.0%')} | {r['vs_copy']:.0%} |"
            for r in bw["decode"]
        ]
    RESULTS.mkdir(exist_ok=True)
    result_path("gpu_check", "json").write_text(json.dumps(results, indent=1, default=str) + "\n")
    result_path("gpu_check", "md").write_text("\n".join(md) + "\n")
    print("\n".join(md))


if __name__ == "__main__":
    sys.exit(main())
