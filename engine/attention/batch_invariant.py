"""Batch-invariant paged attention: every query token reduces over its context in one fixed order.

The default torch backend (`pagedserve.engine.attention.torch_backend`) runs a whole prompt as one
SDPA call, a prompt chunk as another with a bottom-right mask, and decodes as a padded batched
SDPA: the same query token at the same position is summed in a different order when it arrives
in a whole prompt, in a chunk, after a prefix-cache hit or as a decode, and in bf16 the rounding
differs (greedy output was seen to diverge after a few tokens). Here every query token, prefill
or decode, is one row of the same computation over exactly its own visible context, whatever
else shares the step (the design of Thinking Machines' "Defeating Nondeterminism in LLM
Inference": one kernel configuration per query, no split that depends on the batch):

- with the compiled CPU kernel (`pagedserve.kernels.cpu_paged_attention`): one kernel row per
  query token, each with its own sequence's block table and its position + 1 as its length.
  The kernel gives each row to one thread and walks the row's context from token 0 in tiles
  of 4 with float32 math, so a row's result depends only on its query and its context;
- otherwise (another device, float16, a sliding window or soft-capped scores): the same rows
  one at a time in plain torch, every matmul shaped by that row's own context length only.

The cost is prefill attention without a flash kernel: each query row reads its context again.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from pagedserve.engine.attention.kv_dtype import KVCacheDtype
from pagedserve.engine.attention.metadata import AttentionMetadata
from pagedserve.engine.attention.torch_backend import TorchAttentionBackend
from pagedserve.kernels.cpu_paged_attention import paged_decode_attention


@dataclass(slots=True)
class _TokenRows:
    """One row per query token of a step (built once per step, shared by all layers)."""

    meta: AttentionMetadata  # the step this was built for (compared by identity)
    seq_of_row: list[int]  # the sequence of each query row
    lengths: list[int]  # each row's visible context: its position + 1
    block_tables: torch.Tensor  # [T, max_blocks] int32: each row's sequence's table
    seq_lens: torch.Tensor  # [T] int32: `lengths` as a tensor


def _token_rows(meta: AttentionMetadata) -> _TokenRows:
    seq_of_row: list[int] = []
    lengths: list[int] = []
    for i, (q, length) in enumerate(zip(meta.query_lens, meta.seq_lens)):
        seq_of_row.extend([i] * q)
        lengths.extend(range(length - q + 1, length + 1))
    device = meta.block_tables.device
    index = torch.tensor(seq_of_row, dtype=torch.long, device=device)
    return _TokenRows(
        meta,
        seq_of_row,
        lengths,
        meta.block_tables.index_select(0, index),
        torch.tensor(lengths, dtype=torch.int32, device=device),
    )


class BatchInvariantAttentionBackend(TorchAttentionBackend):
    """Paged attention whose result for a query token does not depend on the batch, the chunk
    or the cache hits around it (see the module docstring). Writes K/V like the torch backend."""

    name = "torch-batch-invariant"

    def __init__(self, cpu_kernels=None, kv_dtype: KVCacheDtype = KVCacheDtype.AUTO) -> None:
        super().__init__(cpu_kernels, kv_dtype)
        self._rows: _TokenRows | None = None

    def attend(
        self,
        query: torch.Tensor,
        key: torch.Tensor,
        value: torch.Tensor,
        kv_cache: torch.Tensor,
        meta: AttentionMetadata,
        scale: float,
        window: int | None = None,
        softcap: float | None = None,
    ) -> torch.Tensor:
        del key, value  # every row reads its context from the cache, as a decode does
        if meta.num_seqs == 0:
            return torch.empty_like(query)
        rows = self._rows
        if rows is None or rows.meta is not meta:
            rows = self._rows = _token_rows(meta)
        if window is None and softcap is None and self._kernel_runs(query):
            return paged_decode_attention(
                self._cpu_kernels,
                query,
                kv_cache[0],
                kv_cache[1],
                rows.block_tables,
                rows.seq_lens,
                scale,
                self._kv_quant,
            )
        return self._attend_rows(query, kv_cache, rows, scale, window, softcap)

    def _attend_rows(
        self,
        query: torch.Tensor,
        kv_cache: torch.Tensor,
        rows: _TokenRows,
        scale: float,
        window: int | None,
        softcap: float | None,
    ) -> torch.Tensor:
        """Plain torch, one query row at a time, float32 math: scores, (soft-cap), softmax,
        weighted values over the row's visible context `(p - window, p]`."""
        _, _, block_size, num_kv_heads, width = kv_cache.shape
        num_heads, head_dim = query.shape[1:]
        group = num_heads // num_kv_heads
        keys, values = kv_cache[0].view(-1, num_kv_heads, width), kv_cache[1].view(-1, num_kv_heads, width)
        tables = rows.meta.block_tables.long()
        out = torch.empty_like(query)
        for r, (seq, length) in enumerate(zip(rows.seq_of_row, rows.lengths)):
            first = 0 if window is None else max(0, length - window)
            pos = torch.arange(first, length, device=query.device)
            slots = tables[seq, pos // block_size] * block_size + pos % block_size
            k = self.read_kv(keys.index_select(0, slots), query.dtype).float().permute(1, 2, 0)  # [KVH, D, L]
            v = self.read_kv(values.index_select(0, slots), query.dtype).float().transpose(0, 1)  # [KVH, L, D]
            q = query[r].float().view(num_kv_heads, group, head_dim)
            scores = torch.bmm(q, k) * scale  # [KVH, G, L]
            if softcap is not None:
                scores = torch.tanh(scores / softcap) * softcap
            out[r] = torch.bmm(scores.softmax(dim=-1), v).reshape(num_heads, head_dim).to(query.dtype)
        return out
