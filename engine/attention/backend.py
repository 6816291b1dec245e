"""The attention-backend interface (backend selection: `pagedserve.engine.attention.selector`).

A backend owns one step of paged attention for one layer: it stores the step's new keys/values
in the layer's KV cache and attends every query token to its own sequence's context. The
contract for the batch layout is `pagedserve.engine.attention.metadata.AttentionMetadata`. With a quantized
KV cache (`pagedserve.engine.attention.kv_quant`) the backend quantizes the new keys/values as it stores them
and de-quantizes what it reads.
"""

from __future__ import annotations

import abc

import torch

from pagedserve.engine.attention.kv_dtype import KVCacheDtype, kv_row_width
from pagedserve.engine.attention.kv_quant import dequantize_kv, quantize_kv
from pagedserve.engine.attention.metadata import AttentionMetadata


class AttentionBackend(abc.ABC):
    """Paged attention for one layer at a time.

    Shapes: `query [T, num_heads, head_dim]`, `key`/`value [T, num_kv_heads, head_dim]`,
    `kv_cache [2, num_blocks, block_size, num_kv_heads, head_dim]`; `num_heads` is a multiple of
    `num_kv_heads` and query head `h` uses KV head `h // (num_heads // num_kv_heads)` (HF's
    `repeat_kv` order). query, key and value share one dtype and device; kv_cache has it too,
    or with a quantized `kv_dtype` is uint8 rows of `head_dim + 2` bytes (codes and a scale).
    """

    name: str = "abstract"
    # Sliding windows and soft-capped scores (else a layer with either gets the torch backend:
    # pagedserve.engine.attention.selector.backend_for_layer).
    supports_windows: bool = True

    def __init__(self, kv_dtype: KVCacheDtype = KVCacheDtype.AUTO) -> None:
        self.kv_dtype = kv_dtype

    def read_kv(self, rows: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        """Cache rows as values in `dtype` (de-quantized when the cache is quantized)."""
        return dequantize_kv(rows, self.kv_dtype, dtype) if self.kv_dtype.quantized else rows

    def forward(
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
        """Write key/value at `meta.slot_mapping`, then return attention output `[T, num_heads, head_dim]`.

        Causal: the query token at position p of a sequence sees that sequence's tokens 0..p;
        with a sliding `window` w only (p - w, p]. `softcap`: scores become cap * tanh(s / cap).
        """
        check_shapes(query, key, value, kv_cache, meta, self.kv_dtype)
        if self.kv_dtype.quantized:
            write_kv_cache(
                quantize_kv(key, self.kv_dtype), quantize_kv(value, self.kv_dtype), kv_cache, meta.slot_mapping
            )
        else:
            write_kv_cache(key, value, kv_cache, meta.slot_mapping)
        if window is None and softcap is None:
            return self.attend(query, key, value, kv_cache, meta, scale)
        return self.attend(query, key, value, kv_cache, meta, scale, window=window, softcap=softcap)

    @abc.abstractmethod
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
        """The attention itself, with this step's key/value already in `kv_cache` (`key`/`value`
        are there too, for a backend that reads a whole prompt's K/V without the cache)."""


def write_kv_cache(key: torch.Tensor, value: torch.Tensor, kv_cache: torch.Tensor, slot_mapping: torch.Tensor) -> None:
    """Store `key`/`value [T, kv_heads, width]` (already in the cache's dtype and row width) at
    flat slots `slot_mapping [T]` (int64)."""
    num_kv_heads, width = kv_cache.shape[-2:]
    kv_cache[0].view(-1, num_kv_heads, width).index_copy_(0, slot_mapping, key)
    kv_cache[1].view(-1, num_kv_heads, width).index_copy_(0, slot_mapping, value)


def check_shapes(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    kv_cache: torch.Tensor,
    meta: AttentionMetadata,
    kv_dtype: KVCacheDtype = KVCacheDtype.AUTO,
) -> None:
    """Raise ValueError when the tensors do not fit the backend contract."""
    if query.dim() != 3 or key.dim() != 3 or value.dim() != 3 or kv_cache.dim() != 5:
        raise ValueError("expected query/key/value [T, heads, head_dim] and kv_cache of 5 dims")
    num_tokens, num_heads, head_dim = query.shape
    if kv_cache.shape[0] != 2 or kv_cache.shape[-1] != kv_row_width(head_dim, kv_dtype):
        raise ValueError(
            f"kv_cache shape {tuple(kv_cache.shape)} does not fit head_dim {head_dim} (kv_cache_dtype {kv_dtype.value})"
        )
    kv_shape = (num_tokens, kv_cache.shape[3], head_dim)
    if tuple(key.shape) != kv_shape or tuple(value.shape) != kv_shape:
        raise ValueError(f"key/value must be {kv_shape}, got {tuple(key.shape)} / {tuple(value.shape)}")
    if num_heads % kv_cache.shape[3]:
        raise ValueError(f"num_heads {num_heads} is not a multiple of num_kv_heads {kv_cache.shape[3]}")
    if num_tokens != meta.num_tokens:
        raise ValueError(f"query has {num_tokens} tokens, metadata says {meta.num_tokens}")
    if not (query.dtype == key.dtype == value.dtype):
        raise ValueError("query, key and value must share one dtype")
    cache_dtype = torch.uint8 if kv_dtype.quantized else query.dtype
    if kv_cache.dtype != cache_dtype:
        raise ValueError(f"kv_cache must be {cache_dtype} (kv_cache_dtype {kv_dtype.value}), got {kv_cache.dtype}")
