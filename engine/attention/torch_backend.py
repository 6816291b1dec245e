"""Paged attention in plain torch, tuned for CPU (it also runs on CUDA, slowly).

Decodes (rows [0, num_decodes), one query token each) run as batched SDPA calls, one per group
of similar context length (usually one group): each sequence's K/V is gathered by block table
into a padded `[B, kv_heads, L, head_dim]` copy with one `index_select` per tensor, and q is
viewed as `[B, kv_heads, group, head_dim]`, so grouped-query attention needs no
`repeat_interleave` (bf16 SDPA with `enable_gqa` is 3-4x slower at decode). The gather rows and
masks are built once per step and reused by every layer.
Prefills and prefill chunks run one sequence at a time with SDPA; with the compiled CPU kernel,
chunks of at most SHORT_CHUNK_TOKENS tokens (speculative verification) run instead as one kernel
row per token, together with the decodes.

With a quantized KV cache (`kv_cache_dtype` fp8_e4m3 / int8) the compiled decode kernel reads
the quantized rows itself (codes * scale in its inner loop); without it decodes take the gather +
SDPA path, de-quantizing the gathered rows. Every prefill, whole prompts included, reads its
keys/values back from the cache (with the compiled kernels: one gather + de-quantize pass, rounded
to the query's dtype exactly as `kv_quant.dequantize_kv` rounds), so a prompt sees the same
(quantized) K/V whether or not its prefix was cached.

On glibc the speed can depend heavily on the allocator: the process that runs the model tunes
it once (`pagedserve.engine.platform.process_setup.tune_glibc_malloc`). Without it one process ran the batch-64
decode path in 24 ms instead of 2.5 ms (2 threads, page faults on every temporary); another showed no difference.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from pagedserve.engine.attention import windowed
from pagedserve.engine.attention.backend import AttentionBackend
from pagedserve.engine.attention.kv_dtype import KVCacheDtype
from pagedserve.engine.attention.metadata import AttentionMetadata
from pagedserve.kernels.cpu_paged_attention import gather_dequantize, paged_decode_attention

# Decodes are split into groups of similar context length so that one long sequence does not
# pad the whole batch to its length. A group costs a fixed overhead worth about this many padded
# token slots (one index_select pair + one SDPA call; measured ~76 us vs ~0.11 us per slot).
_GROUP_OVERHEAD_SLOTS = 1024
_GROUP_MIN_RATIO = 0.5


def group_decodes(lengths: list[int]) -> list[list[int]]:
    """Partition decode rows into groups padded to their longest context (longest group first).

    Sorted by length, a new group starts at a row shorter than half the current group's head
    when the padding it saves on this and all shorter rows is worth a group's overhead.
    """
    order = sorted(range(len(lengths)), key=lengths.__getitem__, reverse=True)
    groups = [[order[0]]]
    for rank, row in enumerate(order[1:], start=1):
        head = lengths[groups[-1][0]]
        saved = (head - lengths[row]) * (len(order) - rank)
        if lengths[row] < _GROUP_MIN_RATIO * head and saved >= _GROUP_OVERHEAD_SLOTS:
            groups.append([row])
        else:
            groups[-1].append(row)
    return groups


@dataclass(slots=True)
class _DecodeGroup:
    rows_of_batch: torch.Tensor | None  # [n] int64 decode rows in this group; None = all, in order
    length: int  # L, the group's longest context
    rows: torch.Tensor  # [n * kv_heads * L] int64 rows of the cache viewed as [-1, head_dim]
    mask: torch.Tensor | None  # [n, 1, 1, L] bool, True = attend; None when no row is padded


@dataclass(slots=True)
class _DecodePlan:
    """Gather rows and padding masks for one step's decodes; shared by all layers of the step."""

    meta: AttentionMetadata  # the step this plan was built for (compared by identity)
    block_size: int
    num_kv_heads: int
    groups: list[_DecodeGroup]

    def fits(self, meta: AttentionMetadata, block_size: int, num_kv_heads: int) -> bool:
        return self.meta is meta and self.block_size == block_size and self.num_kv_heads == num_kv_heads


def _build_group(meta: AttentionMetadata, seqs: list[int] | None, block_size: int, num_kv_heads: int) -> _DecodeGroup:
    lengths = meta.seq_lens[: meta.num_decodes] if seqs is None else [meta.seq_lens[i] for i in seqs]
    length = max(lengths)
    device = meta.block_tables.device
    tables = meta.block_tables[: meta.num_decodes]
    index = None
    if seqs is not None:
        index = torch.tensor(seqs, dtype=torch.long, device=device)
        tables = tables.index_select(0, index)
    pos = torch.arange(length, device=device)
    block_ids = tables[:, : (length + block_size - 1) // block_size].long()
    # Padded positions read block_tables' 0 padding: valid memory, masked out below.
    slots = block_ids[:, pos // block_size] * block_size + pos % block_size  # [n, L]
    heads = torch.arange(num_kv_heads, device=device)
    rows = (slots[:, None, :] * num_kv_heads + heads[None, :, None]).reshape(-1)
    mask = None
    if min(lengths) != length:
        lens = torch.tensor(lengths, dtype=torch.long, device=device)
        mask = (pos[None, :] < lens[:, None])[:, None, None, :]
    return _DecodeGroup(index, length, rows, mask)


def _build_decode_plan(meta: AttentionMetadata, block_size: int, num_kv_heads: int) -> _DecodePlan:
    groups = group_decodes(meta.seq_lens[: meta.num_decodes])
    if len(groups) == 1:
        built = [_build_group(meta, None, block_size, num_kv_heads)]
    else:
        built = [_build_group(meta, seqs, block_size, num_kv_heads) for seqs in groups]
    return _DecodePlan(meta, block_size, num_kv_heads, built)


# A chunk of at most this many query tokens after cached context (speculative verification, a
# tiny prompt) runs as that many rows of the C++ decode kernel, one per token, each seeing its
# own prefix, instead of one SDPA call per sequence: 8x fewer calls at batch 8 with 4 drafts.
SHORT_CHUNK_TOKENS = 8


@dataclass(slots=True)
class _ShortChunks:
    meta: AttentionMetadata  # the step this was built for (compared by identity)
    seqs: frozenset[int]  # sequences past the decodes that are short chunks
    token_rows: torch.Tensor  # [R] int64: query rows run by the kernel (decodes, then short chunks)
    block_tables: torch.Tensor  # [R, max_blocks] int32: each row's sequence's table
    seq_lens: torch.Tensor  # [R] int32: each row's visible context (its position + 1)


def _build_short_chunks(meta: AttentionMetadata) -> _ShortChunks:
    seq_of_row: list[int] = []
    lens: list[int] = []
    rows: list[int] = []
    seqs: list[int] = []
    start = 0
    for i, (q, length) in enumerate(zip(meta.query_lens, meta.seq_lens)):
        if q <= SHORT_CHUNK_TOKENS:
            if i >= meta.num_decodes:
                seqs.append(i)
            rows.extend(range(start, start + q))
            seq_of_row.extend([i] * q)
            lens.extend(range(length - q + 1, length + 1))
        start += q
    device = meta.block_tables.device
    index = torch.tensor(seq_of_row, dtype=torch.long, device=device)
    return _ShortChunks(
        meta,
        frozenset(seqs),
        torch.tensor(rows, dtype=torch.long, device=device),
        meta.block_tables.index_select(0, index),
        torch.tensor(lens, dtype=torch.int32, device=device),
    )


class TorchAttentionBackend(AttentionBackend):
    """Plain-torch paged attention (see the module docstring for the layout of the work).

    Holds one cached `_DecodePlan`, rebuilt whenever a new `AttentionMetadata` object arrives:
    the runner must build a fresh metadata object per step (never mutate one in place).
    """

    name = "torch"

    def __init__(self, cpu_kernels=None, kv_dtype: KVCacheDtype = KVCacheDtype.AUTO) -> None:
        super().__init__(kv_dtype)
        self._plan: _DecodePlan | None = None
        self._short: _ShortChunks | None = None
        # The compiled CPU decode kernel (pagedserve.kernels.cpu_paged_attention), or None for pure torch;
        # it reads model-dtype and quantized caches (`_kv_quant`, its name for the kind).
        self._cpu_kernels = cpu_kernels
        self._kv_quant = kv_dtype.value if kv_dtype.quantized else None

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
        num_decodes = meta.num_decodes
        if meta.num_seqs == 0:
            return torch.empty_like(query)
        if softcap is not None or (window is not None and meta.max_seq_len > window):
            return self._attend_windowed(query, key, value, kv_cache, meta, scale, window, softcap)
        if num_decodes == meta.num_seqs:
            return self._decode(query, kv_cache, meta, scale)
        out = torch.empty_like(query)
        short = self._short_chunks(meta) if self._kernel_runs(query) else None
        if short is not None:
            # Decodes and short chunks (speculative verification) as rows of the decode kernel.
            rows = short.token_rows
            out.index_copy_(
                0,
                rows,
                paged_decode_attention(
                    self._cpu_kernels,
                    query.index_select(0, rows),
                    kv_cache[0],
                    kv_cache[1],
                    short.block_tables,
                    short.seq_lens,
                    scale,
                    self._kv_quant,
                ),
            )
        elif num_decodes:
            out[:num_decodes] = self._decode(query[:num_decodes], kv_cache, meta, scale)
        start = num_decodes
        for i in range(num_decodes, meta.num_seqs):
            end = start + meta.query_lens[i]
            if short is None or i not in short.seqs:
                out[start:end] = self._prefill(
                    query[start:end], key[start:end], value[start:end], kv_cache, meta, i, scale
                )
            start = end
        return out

    def _attend_windowed(
        self,
        query: torch.Tensor,
        key: torch.Tensor,
        value: torch.Tensor,
        kv_cache: torch.Tensor,
        meta: AttentionMetadata,
        scale: float,
        window: int | None,
        softcap: float | None,
    ) -> torch.Tensor:
        """A sliding-window or soft-capped layer (pagedserve.engine.attention.windowed): decodes batched over
        their windows, prefill chunks one sequence at a time."""
        out = torch.empty_like(query)
        n = meta.num_decodes
        if n:
            out[:n] = windowed.decode(query[:n], kv_cache, meta, scale, window, softcap, self.read_kv)
        block_size = kv_cache.shape[2]
        start = n
        for i in range(n, meta.num_seqs):
            end = start + meta.query_lens[i]
            seq_len = meta.seq_lens[i]
            k_start = 0
            if meta.query_lens[i] == seq_len and not self.kv_dtype.quantized:
                k, v = key[start:end], value[start:end]
            else:
                # From the block of the first visible position: the blocks before it may be gone.
                first_block = windowed.first_visible(seq_len, meta.query_lens[i], window) // block_size
                k_start = first_block * block_size
                blocks = meta.block_tables[i, first_block : (seq_len + block_size - 1) // block_size]
                k = self._read_context(kv_cache[0], blocks, seq_len - k_start, query.dtype)
                v = self._read_context(kv_cache[1], blocks, seq_len - k_start, query.dtype)
            out[start:end] = windowed.prefill(query[start:end], k, v, seq_len, scale, window, softcap, k_start)
            start = end
        return out

    def _kernel_runs(self, tensor: torch.Tensor, dtype: torch.dtype | None = None) -> bool:
        """Whether the compiled kernels take `tensor` (on CPU; float32 / bfloat16 values: `dtype`,
        or the tensor's own); float16 and other devices take the torch path."""
        return (
            self._cpu_kernels is not None
            and tensor.device.type == "cpu"
            and (dtype or tensor.dtype) in (torch.float32, torch.bfloat16)
        )

    def _short_chunks(self, meta: AttentionMetadata) -> _ShortChunks | None:
        """The step's decodes and short chunks as decode-kernel rows (None: no short chunk)."""
        if self._short is not None and self._short.meta is meta:
            return self._short
        self._short = _build_short_chunks(meta)
        return self._short if self._short.seqs else None

    def _decode(
        self, query: torch.Tensor, kv_cache: torch.Tensor, meta: AttentionMetadata, scale: float
    ) -> torch.Tensor:
        """Rows [0, num_decodes): one query token per sequence, one SDPA call per length group."""
        if self._kernel_runs(query):
            n = query.shape[0]
            return paged_decode_attention(
                self._cpu_kernels,
                query,
                kv_cache[0],
                kv_cache[1],
                meta.block_tables[:n],
                meta.seq_lens_tensor[:n],
                scale,
                self._kv_quant,
            )
        _, _, block_size, num_kv_heads, _ = kv_cache.shape
        plan = self._plan
        if plan is None or not plan.fits(meta, block_size, num_kv_heads):
            plan = self._plan = _build_decode_plan(meta, block_size, num_kv_heads)
        if len(plan.groups) == 1:
            return self._decode_group(query, kv_cache, plan.groups[0], scale)
        out = torch.empty_like(query)
        for group in plan.groups:
            rows = group.rows_of_batch
            assert rows is not None  # only a lone group covers the whole batch
            out.index_copy_(0, rows, self._decode_group(query.index_select(0, rows), kv_cache, group, scale))
        return out

    def _decode_group(
        self, query: torch.Tensor, kv_cache: torch.Tensor, group: _DecodeGroup, scale: float
    ) -> torch.Tensor:
        batch, num_heads, head_dim = query.shape
        num_kv_heads, width = kv_cache.shape[3:]
        shape = (batch, num_kv_heads, group.length, head_dim)
        k = self.read_kv(kv_cache[0].view(-1, width).index_select(0, group.rows), query.dtype).view(shape)
        v = self.read_kv(kv_cache[1].view(-1, width).index_select(0, group.rows), query.dtype).view(shape)
        q = query.reshape(batch, num_kv_heads, num_heads // num_kv_heads, head_dim)
        out = F.scaled_dot_product_attention(q, k, v, attn_mask=group.mask, scale=scale)
        return out.reshape(batch, num_heads, head_dim)

    def _read_context(self, cache: torch.Tensor, blocks: torch.Tensor, length: int, dtype: torch.dtype) -> torch.Tensor:
        """Tokens [0, length) of one sequence from `cache` (a layer's K or V) as `[length, kv_heads,
        head_dim]` values in `dtype`, de-quantized when the cache is quantized."""
        if self._kv_quant is not None and self._kernel_runs(cache, dtype):
            return gather_dequantize(self._cpu_kernels, cache, blocks, length, self._kv_quant, dtype)
        num_kv_heads, width = cache.shape[2:]
        return self.read_kv(cache.index_select(0, blocks).view(-1, num_kv_heads, width)[:length], dtype)

    def _prefill(
        self,
        query: torch.Tensor,
        key: torch.Tensor,
        value: torch.Tensor,
        kv_cache: torch.Tensor,
        meta: AttentionMetadata,
        seq: int,
        scale: float,
    ) -> torch.Tensor:
        """One sequence's chunk of `query_len` tokens that ends its context of `seq_len` tokens."""
        _, _, block_size, num_kv_heads, _ = kv_cache.shape
        query_len, seq_len = meta.query_lens[seq], meta.seq_lens[seq]
        num_heads = query.shape[1]
        # 4-D [1, heads, len, head_dim]: torch's CPU flash kernel takes 4-D inputs only; 3-D ones
        # fell back to a path measured 7-10x slower (bf16, GQA, 200-512 tokens).
        q = query.transpose(0, 1)[None]
        gqa = num_heads != num_kv_heads
        if query_len == seq_len and not self.kv_dtype.quantized:
            k, v = key.transpose(0, 1)[None], value.transpose(0, 1)[None]
        else:
            blocks = meta.block_tables[seq, : (seq_len + block_size - 1) // block_size]
            k = self._read_context(kv_cache[0], blocks, seq_len, query.dtype).transpose(0, 1)[None]
            v = self._read_context(kv_cache[1], blocks, seq_len, query.dtype).transpose(0, 1)[None]
        if query_len == seq_len:
            # The chunk is the whole context: is_causal (top-left aligned) is right.
            out = F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=scale, enable_gqa=gqa)
            return out[0].transpose(0, 1)
        # Bottom-right aligned causal mask: query row r sits at position seq_len - query_len + r.
        device = query.device
        first = seq_len - query_len
        mask = torch.arange(seq_len, device=device)[None, :] <= torch.arange(first, seq_len, device=device)[:, None]
        out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=scale, enable_gqa=gqa)
        return out[0].transpose(0, 1)
