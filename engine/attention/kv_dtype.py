"""The `kv_cache_dtype` option's values and the row width each gives a KV cache row: plain data,
no torch, so that the front end sizes a worker's KV pool without importing it. What the
quantized kinds store and how: pagedserve.engine.attention.kv_quant."""

from __future__ import annotations

import enum

SCALE_BYTES = 2  # one bfloat16 per row


class KVCacheDtype(enum.Enum):
    AUTO = "auto"
    FP8_E4M3 = "fp8_e4m3"
    INT8 = "int8"

    @property
    def quantized(self) -> bool:
        return self is not KVCacheDtype.AUTO


def parse_kv_cache_dtype(value: object) -> KVCacheDtype:
    if isinstance(value, KVCacheDtype):
        return value
    try:
        return KVCacheDtype(str(value).lower())
    except ValueError:
        raise ValueError(
            f"kv_cache_dtype must be one of {', '.join(k.value for k in KVCacheDtype)}, got {value!r}"
        ) from None


def kv_row_width(head_dim: int, kind: KVCacheDtype) -> int:
    """Elements per (token, KV head) row of the cache tensor."""
    return head_dim + SCALE_BYTES if kind.quantized else head_dim


def kv_element_bytes(kind: KVCacheDtype, model_dtype_bytes: int) -> int:
    """Bytes of one element of the cache tensor: the model dtype's, or one for the quantized
    kinds' uint8 rows (pagedserve.engine.attention.kv_quant.kv_storage_dtype)."""
    return 1 if kind.quantized else model_dtype_bytes
