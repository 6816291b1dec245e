"""Paged attention as one Triton kernel, for prefills, prefill chunks and decodes in one launch.

The batch layout is the engine's (pagedserve.engine.attention.metadata, restated here because kernels
never import engine): `num_seqs` sequences laid out one after another in `query [T, H, D]`
(sequence i owns rows `query_start_loc[i]:query_start_loc[i+1]`); each sequence's query tokens
are the last `query_len` of its `seq_len` context tokens; keys/values live in a paged cache
`[num_blocks, block_size, kv_heads, D]`, token t of sequence i in block `block_tables[i, t //
block_size]` at offset `t % block_size`. Attention is causal: a query token at position p sees the
context tokens 0..p. Query head h reads KV head `h // (H // kv_heads)`.

One program handles one sequence, one KV head and a tile of `BLOCK_Q` query tokens, with the
`GROUP` query heads that share the KV head stacked into the rows of one `[BLOCK_Q * GROUP_PAD, D]`
block (a group of 3 is padded to 4), so K and V are read once per group. It walks the context
`TILE` keys at a time (a tile may span several pages: each key's page comes from the block
table), with an online softmax in float32.

A quantized KV cache (`kv_quant` "fp8_e4m3" or "int8"; the format is the engine's
`pagedserve.engine.attention.kv_quant`) is uint8 rows of `D + 2` bytes per token and KV head: D codes, then
the row's bfloat16 scale. The kernel loads the codes and the scale's two bytes and de-quantizes
in float32 (`KV_QUANT`); e4m3 is decoded with integer ops, which the interpreter and every GPU
run alike.

Without a GPU the kernel runs in Triton's interpreter (`TRITON_INTERPRET=1` set before this
module is imported): correct but about a second per launch, for tests only. The interpreter gets
bf16 dot products and reductions wrong (triton-lang/triton#11584), so there the inputs are
upcast to float32 first (`UPCAST`); on a GPU the dots take bf16/fp16 inputs with float32
accumulation, and float32 inputs use IEEE products (no TF32), so a float32 model keeps its
precision.
"""

from __future__ import annotations

import os

import torch
import triton
import triton.language as tl

# Tensor-core dots want at least 16 rows, 16 columns and 16 of depth on a GPU.
MIN_DOT = 16
MAX_BLOCK_M = 64  # query rows (tokens x padded group) per program


def interpreting() -> bool:
    """True when Triton runs kernels in its CPU interpreter (TRITON_INTERPRET=1)."""
    return os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")


KV_QUANT_CODES = {None: 0, "auto": 0, "fp8_e4m3": 1, "int8": 2}
KV_SCALE_BYTES = 2


@triton.jit
def _dequant_kv(codes, row_offsets, cache_ptr, row_ok, HEAD_DIM: tl.constexpr, KV_QUANT: tl.constexpr):
    """uint8 codes `[TILE, D]` of rows starting at `row_offsets [TILE]` -> float32 values."""
    lo = tl.load(cache_ptr + row_offsets + HEAD_DIM, mask=row_ok, other=0).to(tl.int32)
    hi = tl.load(cache_ptr + row_offsets + HEAD_DIM + 1, mask=row_ok, other=0).to(tl.int32)
    scale = ((lo | (hi << 8)) << 16).to(tl.float32, bitcast=True)  # the bf16 bits, widened
    c = codes.to(tl.int32)
    if KV_QUANT == 2:
        vals = (c - ((c >> 7) << 8)).to(tl.float32)  # two's complement int8
    else:
        sign = c >> 7
        exp = (c >> 3) & 15
        man = c & 7
        normal = ((sign << 31) | ((exp + 120) << 23) | (man << 20)).to(tl.float32, bitcast=True)
        subnormal = man.to(tl.float32) * 0.001953125 * (1 - 2 * sign).to(tl.float32)
        vals = tl.where(exp == 0, subnormal, normal)
    return vals * scale[:, None]


@triton.jit
def _paged_attention_kernel(
    out_ptr,
    q_ptr,
    k_cache_ptr,
    v_cache_ptr,
    block_tables_ptr,
    seq_lens_ptr,
    query_start_ptr,
    scale,
    stride_q_tok,
    stride_q_head,
    stride_o_tok,
    stride_o_head,
    stride_k_block,
    stride_k_off,
    stride_k_head,
    stride_v_block,
    stride_v_off,
    stride_v_head,
    stride_bt_seq,
    GROUP: tl.constexpr,
    GROUP_PAD: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    HEAD_DIM_PAD: tl.constexpr,
    BLOCK_SIZE: tl.constexpr,
    TILE: tl.constexpr,
    BLOCK_Q: tl.constexpr,
    UPCAST: tl.constexpr,
    KV_QUANT: tl.constexpr,
):
    seq = tl.program_id(0)
    kv_head = tl.program_id(1)
    q_tile = tl.program_id(2)
    q_start = tl.load(query_start_ptr + seq)
    query_len = tl.load(query_start_ptr + seq + 1) - q_start
    if q_tile * BLOCK_Q < query_len:
        seq_len = tl.load(seq_lens_ptr + seq)
        context_len = seq_len - query_len  # tokens already in the cache before this chunk

        BLOCK_M: tl.constexpr = BLOCK_Q * GROUP_PAD
        rows = tl.arange(0, BLOCK_M)
        tok = q_tile * BLOCK_Q + rows // GROUP_PAD  # query token index within the sequence
        head_in_group = rows % GROUP_PAD
        row_ok = (tok < query_len) & (head_in_group < GROUP)
        head = kv_head * GROUP + head_in_group
        d = tl.arange(0, HEAD_DIM_PAD)
        d_ok = d < HEAD_DIM
        q_offsets = (q_start + tok).to(tl.int64)[:, None] * stride_q_tok + head[:, None] * stride_q_head + d[None, :]
        q = tl.load(q_ptr + q_offsets, mask=row_ok[:, None] & d_ok[None, :], other=0.0)
        if UPCAST:
            q = q.to(tl.float32)
        q_pos = context_len + tok  # each row's position in the sequence

        m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
        l_i = tl.zeros([BLOCK_M], tl.float32)
        acc = tl.zeros([BLOCK_M, HEAD_DIM_PAD], tl.float32)
        # The tile's last query token sees positions < this bound; nothing after it is read.
        kv_end = tl.minimum(context_len + (q_tile + 1) * BLOCK_Q, seq_len)
        offs = tl.arange(0, TILE)
        for start in range(0, kv_end, TILE):
            k_pos = start + offs
            k_ok = k_pos < kv_end
            block_ids = tl.load(block_tables_ptr + seq * stride_bt_seq + k_pos // BLOCK_SIZE, mask=k_ok, other=0)
            slot = k_pos % BLOCK_SIZE
            kv_mask = k_ok[:, None] & d_ok[None, :]
            k_rows = block_ids.to(tl.int64) * stride_k_block + slot * stride_k_off + kv_head * stride_k_head
            v_rows = block_ids.to(tl.int64) * stride_v_block + slot * stride_v_off + kv_head * stride_v_head
            k = tl.load(k_cache_ptr + k_rows[:, None] + d[None, :], mask=kv_mask, other=0)
            v = tl.load(v_cache_ptr + v_rows[:, None] + d[None, :], mask=kv_mask, other=0)
            if KV_QUANT != 0:
                k = _dequant_kv(k, k_rows, k_cache_ptr, k_ok, HEAD_DIM, KV_QUANT)
                v = _dequant_kv(v, v_rows, v_cache_ptr, k_ok, HEAD_DIM, KV_QUANT)
                if not UPCAST:
                    k = k.to(q.dtype)
                    v = v.to(q.dtype)
            elif UPCAST:
                k = k.to(tl.float32)
                v = v.to(tl.float32)
            s = tl.dot(q, tl.trans(k), input_precision="ieee") * scale
            allowed = (k_pos[None, :] <= q_pos[:, None]) & k_ok[None, :]
            s = tl.where(allowed, s, float("-inf"))
            # Key 0 is visible to every row, so after the first tile each row's max is finite.
            m_new = tl.maximum(m_i, tl.max(s, 1))
            alpha = tl.exp(m_i - m_new)
            p = tl.exp(s - m_new[:, None])
            l_i = l_i * alpha + tl.sum(p, 1)
            acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision="ieee")
            m_i = m_new
        acc = acc / l_i[:, None]
        o_offsets = (q_start + tok).to(tl.int64)[:, None] * stride_o_tok + head[:, None] * stride_o_head + d[None, :]
        tl.store(out_ptr + o_offsets, acc.to(out_ptr.dtype.element_ty), mask=row_ok[:, None] & d_ok[None, :])


def paged_attention(
    query: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    block_tables: torch.Tensor,
    seq_lens: torch.Tensor,
    query_start_loc: torch.Tensor,
    max_query_len: int,
    scale: float,
    kv_quant: str | None = None,
) -> torch.Tensor:
    """Causal paged attention of every query token over its sequence's context.

    `query [T, H, D]`; `key_cache`/`value_cache [num_blocks, block_size, kv_heads, D]` (last dim
    contiguous), or with `kv_quant` ("fp8_e4m3" / "int8") uint8 `[..., D + 2]` rows;
    `block_tables [num_seqs, max_blocks]` int32; `seq_lens [num_seqs]` int32;
    `query_start_loc [num_seqs + 1]` int32. Returns `[T, H, D]` in query's dtype.
    """
    num_tokens, num_heads, head_dim = query.shape
    _, block_size, num_kv_heads, width = key_cache.shape
    if kv_quant not in KV_QUANT_CODES:
        raise ValueError(f"kv_quant must be one of {sorted(k for k in KV_QUANT_CODES if k)}, got {kv_quant!r}")
    quant = KV_QUANT_CODES[kv_quant]
    want = (torch.uint8, head_dim + KV_SCALE_BYTES) if quant else (query.dtype, head_dim)
    if (key_cache.dtype, width) != want or (value_cache.dtype, value_cache.shape[-1]) != want:
        raise ValueError(
            f"caches must be {want[0]} rows of {want[1]} (kv_quant {kv_quant!r}), got "
            f"{key_cache.dtype} / {value_cache.dtype} rows of {width} / {value_cache.shape[-1]}"
        )
    if num_heads % num_kv_heads:
        raise ValueError(f"num_heads {num_heads} is not a multiple of num_kv_heads {num_kv_heads}")
    if query.stride(-1) != 1 or key_cache.stride(-1) != 1 or value_cache.stride(-1) != 1:
        raise ValueError("query and the caches need a contiguous last dimension")
    out = torch.empty_like(query)
    num_seqs = seq_lens.shape[0]
    if num_tokens == 0 or num_seqs == 0:
        return out
    group = num_heads // num_kv_heads
    group_pad = triton.next_power_of_2(group)
    # Enough query tokens per program to fill a dot's 16 rows, more for prefills.
    block_q = max(1, MIN_DOT // group_pad)
    block_q = max(block_q, min(triton.next_power_of_2(max_query_len), MAX_BLOCK_M // group_pad))
    tile = max(MIN_DOT, block_size)
    grid = (num_seqs, num_kv_heads, triton.cdiv(max_query_len, block_q))
    _paged_attention_kernel[grid](
        out,
        query,
        key_cache,
        value_cache,
        block_tables,
        seq_lens,
        query_start_loc,
        scale,
        query.stride(0),
        query.stride(1),
        out.stride(0),
        out.stride(1),
        key_cache.stride(0),
        key_cache.stride(1),
        key_cache.stride(2),
        value_cache.stride(0),
        value_cache.stride(1),
        value_cache.stride(2),
        block_tables.stride(0),
        GROUP=group,
        GROUP_PAD=group_pad,
        HEAD_DIM=head_dim,
        HEAD_DIM_PAD=max(MIN_DOT, triton.next_power_of_2(head_dim)),
        BLOCK_SIZE=block_size,
        TILE=tile,
        BLOCK_Q=block_q,
        UPCAST=interpreting() and query.dtype != torch.float32,
        KV_QUANT=quant,
    )
    return out


def paged_attention_reference(
    query: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    block_tables: torch.Tensor,
    seq_lens: torch.Tensor,
    query_start_loc: torch.Tensor,
    scale: float,
) -> torch.Tensor:
    """The same attention in plain torch, one sequence at a time, in float32."""
    num_heads = query.shape[1]
    block_size, num_kv_heads = key_cache.shape[1], key_cache.shape[2]
    out = torch.empty_like(query)
    starts = query_start_loc.tolist()
    for i, seq_len in enumerate(seq_lens.tolist()):
        lo, hi = starts[i], starts[i + 1]
        if lo == hi:
            continue
        pos = torch.arange(seq_len, device=query.device)
        blocks = block_tables[i].long()[pos // block_size]
        k = key_cache[blocks, pos % block_size].float()  # [L, kv_heads, D]
        v = value_cache[blocks, pos % block_size].float()
        k = k.repeat_interleave(num_heads // num_kv_heads, dim=1)
        v = v.repeat_interleave(num_heads // num_kv_heads, dim=1)
        q = query[lo:hi].float()
        scores = torch.einsum("qhd,khd->hqk", q, k) * scale
        q_pos = torch.arange(seq_len - (hi - lo), seq_len, device=query.device)
        scores = scores.masked_fill(pos[None, None, :] > q_pos[None, :, None], float("-inf"))
        out[lo:hi] = torch.einsum("hqk,khd->qhd", scores.softmax(-1), v).to(query.dtype)
    return out
