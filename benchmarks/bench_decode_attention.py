"""Decode attention, one layer, SmolLM2-135M shapes: our torch backend against simpler baselines.

    python benchmarks/bench_decode_attention.py [--batch 64] [--contexts uniform|skewed]
        [--dtype bfloat16] [--no-malloc-tune] [--compile]

Each variant runs over `--layers` distinct caches in turn (default 30, like the model), so every
call reads a cache that is cold as in a real step; rounds are interleaved and the median ms per
layer is printed.

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
"""

from __future__ import annotations

import argparse
import os
import statistics
import time

import torch
import torch.nn.functional as F

from engine.attention.backend import write_kv_cache
from engine.attention.metadata import AttentionMetadata
from engine.attention.torch_backend import TorchAttentionBackend, _build_decode_plan
from engine.process_setup import tune_glibc_malloc


def context_lengths(kind: str, batch: int, g: torch.Generator) -> list[int]:
    """uniform: 200-400 tokens; skewed: 1/16 of the rows 1500-2000 tokens, the rest 100-150."""
    if kind == "uniform":
        return torch.randint(200, 401, (batch,), generator=g).tolist()
    long_rows = max(1, batch // 16)
    return (torch.randint(1500, 2001, (long_rows,), generator=g).tolist()
            + torch.randint(100, 151, (batch - long_rows,), generator=g).tolist())


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
        num_seqs=batch, num_tokens=batch, query_lens=[1] * batch, seq_lens=seq_lens,
        query_start_loc=torch.arange(batch + 1, dtype=torch.int32),
        seq_lens_tensor=torch.tensor(seq_lens, dtype=torch.int32),
        block_tables=torch.tensor(tables, dtype=torch.int32),
        slot_mapping=torch.tensor(slots, dtype=torch.int64),
        max_query_len=1, max_seq_len=max(seq_lens), num_decodes=batch,
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
    times = []
    for _ in range(reps):
        start = time.perf_counter()
        for cache in caches:
            fn(cache)
        times.append((time.perf_counter() - start) / len(caches))
    return statistics.median(times) * 1e3


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
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    tuned = False if args.no_malloc_tune else tune_glibc_malloc()
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
        results: dict[str, list[float]] = {name: [] for name in variants}
        for _ in range(args.rounds):
            for name, fn in variants.items():
                results[name].append(ms_per_layer(fn, caches, args.reps))
    print(f"B={args.batch} {args.dtype} threads={args.threads} malloc_tuned={tuned} layers={args.layers} "
          f"contexts {args.contexts} (mean {sum(meta.seq_lens) / len(meta.seq_lens):.0f}, max {max(meta.seq_lens)}), "
          f"decode groups {len(_build_decode_plan(meta, 16, 3).groups)}")
    for name, values in results.items():
        print(f"{name:9s} median {statistics.median(values):7.3f} ms/layer   rounds: "
              + " ".join(f"{v:.2f}" for v in values))


if __name__ == "__main__":
    main()
