"""Decode attention, one layer, SmolLM2-135M shapes: our torch backend against simpler baselines.

    python benchmarks/bench_decode_attention.py [--batch 64] [--contexts uniform|skewed]
        [--dtype bfloat16] [--no-malloc-tune] [--compile]
    python benchmarks/bench_decode_attention.py --kv-compare [--batches 16,64] [--prefill-len 1000]
        [--kv-variants auto,fp8_e4m3,int8,fp8_e4m3-torch,int8-torch]

Each variant runs over `--layers` distinct caches in turn (default 30, like the model), so every
call reads a cache that is cold as in a real step; rounds are interleaved (the harness's
alternating_rounds) and the median ms per layer is printed.

Variants:
  loop      per-sequence block gather + SDPA (the naive path)
  padded    one padded block gather `cache[block_tables]` + transpose + SDPA with a bool mask
  backend   TorchAttentionBackend.forward with the step's plan already built (what layers 2..N
            of a step pay; includes writing the new K/V)
  plan      building the per-step decode plan (paid once per step, not per layer)
  compiled  (--compile) torch.compile(dynamic=False) of gather + q.k + softmax + .v, fused by inductor

--compile measures only `compiled` and then `backend` again: once inductor's compiled code has
run, eager ops in the same process were seen 2-3x slower (its OpenMP pool competes with torch's),
so compiled and eager numbers must come from separate runs.

--kv-compare times the attention of a whole decode step (all `--layers` layers: quantize and
write the new K/V, attend) for each KV cache dtype, as the engine runs it on CPU (the backend with
the compiled kernel), against bf16 KV: `auto` (bf16), `fp8_e4m3`, `int8`, and each quantized kind
without the compiled kernel (`*-torch`: gather + de-quantize + SDPA, the path before the kernel
read quantized caches). Also a whole-prompt prefill of `--prefill-len` tokens (every layer writes
its K/V and attends; quantized kinds read them back through the cache). Paired rounds: every
round times every variant, the order reversed every other round; the result is the median of the
per-round ratios bf16 time / variant time (> 1: faster than bf16). The matmuls of a step do not
depend on the KV dtype and are not timed. Writes benchmarks/results/kv_quant_decode.<cpu-kind>.{json,md}.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time

import torch
import torch.nn.functional as F
from _common import RESULTS, result_path

from pagedserve.engine.attention.backend import write_kv_cache
from pagedserve.engine.attention.kv_dtype import KVCacheDtype
from pagedserve.engine.attention.kv_quant import quantize_kv
from pagedserve.engine.attention.metadata import AttentionMetadata
from pagedserve.engine.attention.torch_backend import TorchAttentionBackend, _build_decode_plan
from pagedserve.engine.platform.process_setup import tune_glibc_malloc
from pagedserve.kernels.cpu_paged_attention import load_cpu_kernels
from pagedserve.server.commands.bench.harness import (
    PairedRounds,
    alternating_rounds,
    median_call_s,
    provenance,
    stamp,
)


def context_lengths(kind: str, batch: int, g: torch.Generator) -> list[int]:
    """uniform: 200-400 tokens; skewed: 1/16 of the rows 1500-2000 tokens, the rest 100-150."""
    if kind == "uniform":
        return torch.randint(200, 401, (batch,), generator=g).tolist()
    long_rows = max(1, batch // 16)
    return (
        torch.randint(1500, 2001, (long_rows,), generator=g).tolist()
        + torch.randint(100, 151, (batch - long_rows,), generator=g).tolist()
    )


def make_batch(batch: int, contexts: str, heads: int, kv_heads: int, head_dim: int, block_size: int, dtype):
    g = torch.Generator().manual_seed(0)
    seq_lens = context_lengths(contexts, batch, g)
    blocks_per_seq = [(s + block_size - 1) // block_size for s in seq_lens]
    num_blocks = sum(blocks_per_seq) + 16
    perm = torch.randperm(num_blocks, generator=g).tolist()
    tables, offset = [], 0
    for n in blocks_per_seq:
        tables.append(perm[offset : offset + n] + [0] * (max(blocks_per_seq) - n))
        offset += n
    cache = torch.randn(2, num_blocks, block_size, kv_heads, head_dim, generator=g).to(dtype)
    slots = [tables[i][(s - 1) // block_size] * block_size + (s - 1) % block_size for i, s in enumerate(seq_lens)]
    meta = AttentionMetadata(
        num_seqs=batch,
        num_tokens=batch,
        query_lens=[1] * batch,
        seq_lens=seq_lens,
        query_start_loc=torch.arange(batch + 1, dtype=torch.int32),
        seq_lens_tensor=torch.tensor(seq_lens, dtype=torch.int32),
        block_tables=torch.tensor(tables, dtype=torch.int32),
        slot_mapping=torch.tensor(slots, dtype=torch.int64),
        max_query_len=1,
        max_seq_len=max(seq_lens),
        num_decodes=batch,
    )
    q = torch.randn(batch, heads, head_dim, generator=g).to(dtype)
    kv = torch.randn(batch, kv_heads, head_dim, generator=g).to(dtype)
    write_kv_cache(kv, kv, cache, meta.slot_mapping)  # so the backend's own write changes nothing
    return cache, meta, q, kv


def loop_attention(q, cache, meta, scale):
    out = []
    block_size, kv_heads, head_dim = cache.shape[2:]
    for i, seq_len in enumerate(meta.seq_lens):
        blocks = meta.block_tables[i, : (seq_len + block_size - 1) // block_size]
        k = cache[0, blocks].view(-1, kv_heads, head_dim)[:seq_len].transpose(0, 1)
        v = cache[1, blocks].view(-1, kv_heads, head_dim)[:seq_len].transpose(0, 1)
        qi = q[i].view(kv_heads, -1, head_dim)
        out.append(F.scaled_dot_product_attention(qi, k, v, scale=scale).reshape(-1, head_dim))
    return torch.stack(out)


def padded_attention(q, cache, meta, scale):
    batch, heads, head_dim = q.shape
    kv_heads = cache.shape[3]
    tables = meta.block_tables.long()
    k = cache[0][tables].view(batch, -1, kv_heads, head_dim).transpose(1, 2)
    v = cache[1][tables].view(batch, -1, kv_heads, head_dim).transpose(1, 2)
    mask = torch.arange(k.shape[2])[None, :] < meta.seq_lens_tensor[:, None]
    qg = q.view(batch, kv_heads, heads // kv_heads, head_dim)
    return F.scaled_dot_product_attention(qg, k, v, attn_mask=mask[:, None, None, :], scale=scale).reshape(q.shape)


def fused_attention(q, cache, tables, mask, scale: float):
    """Written for inductor to fuse the gather into the reductions (K/V never copied out)."""
    batch, heads, head_dim = q.shape
    kv_heads = cache.shape[3]
    k = cache[0][tables].flatten(1, 2)  # [B, L, kv_heads, D]
    v = cache[1][tables].flatten(1, 2)
    qg = q.view(batch, 1, kv_heads, heads // kv_heads, head_dim).float()
    s = (qg * k[:, :, :, None, :].float()).sum(-1) * scale  # [B, L, kv_heads, group]
    p = torch.softmax(s.masked_fill(~mask[:, :, None, None], float("-inf")), dim=1)
    return (p[..., None] * v[:, :, :, None, :].float()).sum(1).reshape(q.shape).to(q.dtype)


def ms_per_layer(fn, caches: list[torch.Tensor], reps: int) -> float:
    """Median over `reps` passes of the mean time of `fn(cache)` over all caches."""

    def one_pass() -> None:
        for cache in caches:
            fn(cache)

    return median_call_s(one_pass, reps, warmup=0) / len(caches) * 1e3


KV_VARIANTS = ("auto", "fp8_e4m3", "int8", "fp8_e4m3-torch", "int8-torch")


def prefill_batch(length: int, heads: int, kv_heads: int, head_dim: int, block_size: int, dtype):
    """One whole prompt of `length` tokens in scrambled blocks."""
    g = torch.Generator().manual_seed(1)
    num_blocks = (length + block_size - 1) // block_size
    table = torch.randperm(num_blocks + 4, generator=g)[:num_blocks]
    pos = torch.arange(length)
    meta = AttentionMetadata(
        num_seqs=1,
        num_tokens=length,
        query_lens=[length],
        seq_lens=[length],
        query_start_loc=torch.tensor([0, length], dtype=torch.int32),
        seq_lens_tensor=torch.tensor([length], dtype=torch.int32),
        block_tables=table[None].int(),
        slot_mapping=table[pos // block_size] * block_size + pos % block_size,
        max_query_len=length,
        max_seq_len=length,
        num_decodes=0,
    )
    cache = torch.zeros(2, num_blocks + 4, block_size, kv_heads, head_dim, dtype=dtype)
    q = torch.randn(length, heads, head_dim, generator=g).to(dtype)
    kv = torch.randn(length, kv_heads, head_dim, generator=g).to(dtype)
    return cache, meta, q, kv


def kv_variant(name: str, ext, cache, meta, q, kv, layers: int):
    """A function that runs one step's attention (all layers) with KV variant `name`."""
    kind = KVCacheDtype(name.removesuffix("-torch"))
    backend = TorchAttentionBackend(cpu_kernels=None if name.endswith("-torch") else ext, kv_dtype=kind)
    if kind.quantized:
        cache = quantize_kv(cache, kind)
    caches = [cache.clone() for _ in range(layers)]
    scale = q.shape[-1] ** -0.5

    def step() -> None:
        for c in caches:
            backend.forward(q, kv, kv, c, meta, scale)

    return step


def paired_rounds(steps: dict, rounds: int, reps: int) -> dict[str, list[dict]]:
    """ms per step of every variant, each round in alternating order (the shared harness's
    alternating_rounds; median of `reps` runs)."""
    return alternating_rounds(
        list(steps), lambda name: {"ms": median_call_s(steps[name], reps, warmup=0) * 1e3}, rounds
    )


def kv_compare(args) -> None:
    ext = load_cpu_kernels()
    if ext is None:
        raise SystemExit("the CPU kernel could not be built: --kv-compare compares it")
    dtype = getattr(torch, args.dtype)
    workloads = [(f"decode B={b}", make_batch(b, args.contexts, 9, 3, 64, 16, dtype)) for b in args.batches]
    if args.prefill_len:
        workloads.append((f"prefill {args.prefill_len} tokens", prefill_batch(args.prefill_len, 9, 3, 64, 16, dtype)))
    lines = [
        "# Quantized KV cache vs bf16 KV: decode-step and prefill attention (CPU)",
        "",
        "",
        f"`benchmarks/bench_decode_attention.py --kv-compare`: {args.dtype} queries, threads={args.threads}, "
        f"layers={args.layers}, contexts {args.contexts}, {args.rounds} paired rounds (every variant once per "
        "round, the order reversed every other round); ratio = bf16 KV time / variant time (median of "
        "per-round ratios).",
        "",
        "| workload | KV | median ms per step | ratio vs bf16 KV | per-round ratios |",
        "| --- | --- | --- | --- | --- |",
    ]
    loads, summary = [], {}
    with torch.inference_mode():
        for label, (cache, meta, q, kv) in workloads:
            steps = {name: kv_variant(name, ext, cache, meta, q, kv, args.layers) for name in args.kv_variants}
            for step in steps.values():
                step()  # warm-up (first touch of the caches, the decode plan)
            times = paired_rounds(steps, args.rounds, args.reps)
            loads.append(os.getloadavg()[0])
            for name, values in times.items():
                # candidate / baseline = bf16 time / this variant's time
                p = PairedRounds(name, "auto", "ms", runs={name: values, "auto": times["auto"]})
                summary[f"{label} {name}"] = {"ms": p.side_median(name), "ratio": p.ratio_median, "ratios": p.ratios}
                lines.append(
                    f"| {label} | {name} | {p.side_median(name):.2f} | {p.ratio_median:.3f}x | "
                    + ", ".join(f"{x:.2f}" for x in p.ratios)
                    + " |"
                )
                print(lines[-1], flush=True)
            del steps
    record = provenance(loads)
    RESULTS.mkdir(exist_ok=True)
    lines[2:2] = [stamp(record), ""]
    result_path("kv_quant_decode", "json").write_text(json.dumps({**record, **summary}, indent=1) + "\n")
    result_path("kv_quant_decode", "md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--batch", type=int, default=64)
    parser.add_argument("--contexts", default="uniform", choices=["uniform", "skewed"])
    parser.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float32"])
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--reps", type=int, default=3)
    parser.add_argument("--layers", type=int, default=30)
    parser.add_argument("--no-malloc-tune", action="store_true")
    parser.add_argument("--compile", action="store_true")
    parser.add_argument("--kv-compare", action="store_true", help="bf16 vs fp8_e4m3 / int8 KV cache (see above)")
    parser.add_argument("--batches", default="16,64", help="--kv-compare's decode batch sizes")
    parser.add_argument("--prefill-len", type=int, default=1000, help="--kv-compare's prompt (0: none)")
    parser.add_argument("--kv-variants", default=",".join(KV_VARIANTS), help="--kv-compare's variants (auto first)")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    tuned = False if args.no_malloc_tune else tune_glibc_malloc()
    if args.kv_compare:
        args.batches = [int(b) for b in args.batches.split(",")]
        args.kv_variants = args.kv_variants.split(",")
        if args.kv_variants[0] != "auto" or not set(args.kv_variants) <= set(KV_VARIANTS):
            parser.error(f"--kv-variants: auto first, then any of {', '.join(KV_VARIANTS[1:])}")
        print(f"malloc_tuned={tuned}")
        kv_compare(args)
        return
    dtype = getattr(torch, args.dtype)
    cache, meta, q, kv = make_batch(args.batch, args.contexts, 9, 3, 64, 16, dtype)
    scale = 64**-0.5
    backend = TorchAttentionBackend()
    caches = [cache] + [cache.clone() for _ in range(args.layers - 1)]
    variants = {
        "loop": lambda c: loop_attention(q, c, meta, scale),
        "padded": lambda c: padded_attention(q, c, meta, scale),
        "backend": lambda c: backend.forward(q, kv, kv, c, meta, scale),
        "plan": lambda c: _build_decode_plan(meta, 16, 3),
    }
    if args.compile:
        tables = meta.block_tables.long()
        mask = torch.arange(tables.shape[1] * 16)[None, :] < meta.seq_lens_tensor[:, None]
        os.environ.setdefault("TORCHINDUCTOR_COMPILE_THREADS", "1")  # no compile workers left competing
        compiled = torch.compile(fused_attention, dynamic=False)
        start = time.perf_counter()
        compiled(q, cache, tables, mask, scale)
        print(f"compile: {time.perf_counter() - start:.1f} s")
        variants = {"compiled": lambda c: compiled(q, c, tables, mask, scale), "backend": variants["backend"]}
    with torch.inference_mode():
        reference = loop_attention(q, cache, meta, scale).float()
        for name, fn in variants.items():
            if name != "plan":
                err = (fn(cache).float() - reference).abs().max().item()
                print(f"{name:9s} max |diff| vs loop: {err:.2e}")
        results = alternating_rounds(
            list(variants), lambda name: ms_per_layer(variants[name], caches, args.reps), args.rounds
        )
    print(
        f"B={args.batch} {args.dtype} threads={args.threads} malloc_tuned={tuned} layers={args.layers} "
        f"contexts {args.contexts} (mean {sum(meta.seq_lens) / len(meta.seq_lens):.0f}, max {max(meta.seq_lens)}), "
        f"decode groups {len(_build_decode_plan(meta, 16, 3).groups)}"
    )
    for name, values in results.items():
        print(
            f"{name:9s} median {statistics.median(values):7.3f} ms/layer   rounds: "
            + " ".join(f"{v:.2f}" for v in values)
        )


if __name__ == "__main__":
    main()
