"""How many bytes a KV block takes and how many blocks a worker's pool holds: plain arithmetic
over the model's spec and the engine config, no torch, so that the server's front end budgets a
worker's memory before one starts (pagedserve.server.workers.memory_budget) by the rule the
engine allocates with (pagedserve.engine.model.loader.allocate_kv_caches)."""

from __future__ import annotations

from typing import Any

from pagedserve.engine.attention.kv_dtype import KVCacheDtype, kv_element_bytes, kv_row_width
from pagedserve.engine.config.engine import EngineConfig, dtype_itemsize
from pagedserve.engine.kv_cache.groups import KVCacheLayout, plan_layout
from pagedserve.engine.model.registry import parse_config
from pagedserve.engine.model.spec import ModelSpec


def as_spec(config: Any) -> ModelSpec:
    """A ModelSpec, or a config.json dict parsed by its family."""
    return config if isinstance(config, ModelSpec) else parse_config(config)


def kv_cache_bytes_per_block(
    config: Any,
    block_size: int,
    dtype: Any,  # a dtype name or a torch.dtype
    kv_dtype: KVCacheDtype = KVCacheDtype.AUTO,
    num_layers: int | None = None,
) -> int:
    """Bytes one KV block takes (keys and values) across `num_layers` layers (default: all; a
    hybrid KV cache's block is a page of `KVCacheLayout.num_tensors` layers)."""
    spec = as_spec(config)
    itemsize = kv_element_bytes(kv_dtype, dtype_itemsize(dtype))
    layers = spec.num_layers if num_layers is None else num_layers
    return 2 * layers * block_size * spec.num_kv_heads * kv_row_width(spec.head_dim, kv_dtype) * itemsize


def kv_layout(config: EngineConfig, spec: ModelSpec) -> KVCacheLayout:
    """The KV cache groups of `spec` under `config` (pagedserve.engine.kv_cache.groups): hybrid
    unless turned off, or with tensor parallelism (the ranks' pools are one group) or KV offload
    (its connector copies one block table across every layer)."""
    hybrid = config.hybrid_kv_cache and config.tensor_parallel_size == 1 and config.kv_offload_config is None
    return plan_layout([spec.window_of(i) for i in range(spec.num_layers)], hybrid)


def kv_pool_size(config: EngineConfig, rank_spec: ModelSpec, kv_dtype: KVCacheDtype) -> tuple[int, int]:
    """(bytes one KV block takes in the whole worker, blocks in the pool) for a model whose
    process holds the KV heads of `rank_spec` (all of them, or a tensor-parallel rank's share).

    `kv_cache_memory` is the whole worker's budget: each of its N tensor-parallel ranks holds
    every block for its own KV heads, so N ranks with 1/N of the heads hold as many blocks as one
    process with all of them (KV heads replicated on several ranks cost their copies). Every
    rank computes the same count. A block is a page of the layout's shared tensors."""
    layers = kv_layout(config, rank_spec).num_tensors
    total = (
        kv_cache_bytes_per_block(rank_spec, config.block_size, config.dtype, kv_dtype, layers)
        * config.tensor_parallel_size
    )
    return total, config.resolve_num_blocks(total)
