"""Paged attention with a sliding window and/or soft-capped scores, in plain torch (the CPU path
of Mistral, Qwen's sliding layers, Phi-3, Gemma 2 / 3).

A query token at position p of a sliding layer with window w sees positions (p - w, p]: itself
and the w - 1 tokens before it, as transformers' sliding-window mask. Soft-capping maps each
score s (already scaled) to `cap * tanh(s / cap)` before the mask and the softmax (Gemma 2);
the softmax then runs in float32 and is cast back, as transformers' eager attention does.

Decodes gather only the window of each sequence (`[B, kv_heads, W, head_dim]`, padded to the
longest visible context and masked); prefill chunks gather the window before their first token
onwards. Blocks wholly before the window are never read: a hybrid KV cache
(pagedserve.engine.kv_cache.groups) has already returned them to the pool.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F

from pagedserve.engine.attention.metadata import AttentionMetadata

# (cache rows [n, kv_heads, width]) -> values in the query's dtype (de-quantized when needed)
ReadRows = Callable[[torch.Tensor, torch.dtype], torch.Tensor]


def attention(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor | None, scale: float, softcap: float | None
) -> torch.Tensor:
    """`q [B, kv_heads, G, D]` (G query rows per KV head) against `k`/`v [B, kv_heads, L, D]`
    with a bool `mask` (True = attend) broadcastable to `[B, kv_heads, G, L]`."""
    if softcap is None:
        return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=scale)
    scores = torch.matmul(q, k.transpose(-1, -2)) * scale
    scores = torch.tanh(scores / softcap) * softcap
    if mask is not None:
        scores = scores.masked_fill(~mask, float("-inf"))
    probs = torch.softmax(scores, dim=-1, dtype=torch.float32).to(q.dtype)
    return torch.matmul(probs, v)


def decode(
    query: torch.Tensor,
    kv_cache: torch.Tensor,
    meta: AttentionMetadata,
    scale: float,
    window: int | None,
    softcap: float | None,
    read: ReadRows,
) -> torch.Tensor:
    """Rows [0, num_decodes): one query token per sequence, attending to the last `window`
    tokens of its context (all of them for None)."""
    batch, num_heads, head_dim = query.shape
    _, _, block_size, num_kv_heads, width = kv_cache.shape
    device = query.device
    lengths = torch.tensor(meta.seq_lens[:batch], dtype=torch.long, device=device)
    visible = lengths if window is None else lengths.clamp(max=window)
    span = int(visible.max())
    start = lengths - visible  # first visible position of each sequence
    pos = start[:, None] + torch.arange(span, device=device)[None, :]  # [B, span]
    valid = pos < lengths[:, None]
    pos = pos.masked_fill(~valid, 0)  # padding reads position 0: valid memory, masked out
    tables = meta.block_tables[:batch].long()
    slots = tables.gather(1, pos // block_size) * block_size + pos % block_size
    shape = (batch, span, num_kv_heads, head_dim)
    k = read(kv_cache[0].view(-1, num_kv_heads, width).index_select(0, slots.reshape(-1)), query.dtype)
    v = read(kv_cache[1].view(-1, num_kv_heads, width).index_select(0, slots.reshape(-1)), query.dtype)
    k, v = k.view(shape).transpose(1, 2), v.view(shape).transpose(1, 2)
    q = query.reshape(batch, num_kv_heads, num_heads // num_kv_heads, head_dim)
    mask = None if bool(valid.all()) else valid[:, None, None, :]
    return attention(q, k, v, mask, scale, softcap).reshape(batch, num_heads, head_dim)


def prefill(
    query: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    seq_len: int,
    scale: float,
    window: int | None,
    softcap: float | None,
    k_start: int = 0,
) -> torch.Tensor:
    """One sequence's chunk `query [Q, heads, D]`, the last Q positions of its context, against
    `k`/`v [seq_len - k_start, kv_heads, D]` (its context from position `k_start`, at most
    `first_visible`); causal, within the window."""
    query_len, num_heads, head_dim = query.shape
    num_kv_heads = k.shape[1]
    first = seq_len - query_len
    lo = first_visible(seq_len, query_len, window)  # nothing before lo is visible
    k, v = k[lo - k_start :].transpose(0, 1)[None], v[lo - k_start :].transpose(0, 1)[None]
    qpos = torch.arange(first, seq_len, device=query.device)[:, None]
    kpos = torch.arange(lo, seq_len, device=query.device)[None, :]
    mask = kpos <= qpos
    if window is not None:
        mask &= kpos > qpos - window
    group = num_heads // num_kv_heads
    # [1, kv_heads, group * Q, D]: each KV head's query heads one after another
    q = query.transpose(0, 1).reshape(1, num_kv_heads, group * query_len, head_dim)
    out = attention(q, k, v, mask.repeat(group, 1), scale, softcap)
    return out.reshape(num_heads, query_len, head_dim).transpose(0, 1)


def first_visible(seq_len: int, query_len: int, window: int | None) -> int:
    """The first position a chunk of the last `query_len` of `seq_len` positions can see."""
    return 0 if window is None else max(0, seq_len - query_len - window + 1)
