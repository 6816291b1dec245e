"""The memory budget's KV pool under tensor parallelism (issue 34): it counts what the ranks
allocate, replicated KV heads included, by the engine's own rule."""

from __future__ import annotations

import pytest

from pagedserve.engine.config.engine import EngineConfig
from pagedserve.server.workers.memory_budget import kv_pool_bytes

LAYERS, HIDDEN, HEADS = 2, 32, 4
HEAD_DIM = HIDDEN // HEADS


def hf(kv_heads: int) -> dict:
    return {
        "architectures": ["LlamaForCausalLM"],
        "hidden_size": HIDDEN,
        "intermediate_size": 64,
        "num_hidden_layers": LAYERS,
        "num_attention_heads": HEADS,
        "num_key_value_heads": kv_heads,
        "vocab_size": 128,
        "max_position_embeddings": 256,
        "rms_norm_eps": 1e-5,
    }


def block_bytes(kv_heads: int) -> int:  # keys and values, every layer, 16 tokens, float32
    return 2 * LAYERS * 16 * kv_heads * HEAD_DIM * 4


@pytest.mark.parametrize(
    "kv_heads, tp, held_heads",
    [
        (4, 1, 4),
        (4, 2, 4),  # 2 heads on each rank
        (4, 4, 4),
        (2, 4, 4),  # each of 4 ranks holds a copy of one of the 2 heads
        (1, 2, 2),  # the one KV head on both ranks
        (1, 4, 4),
    ],
)
def test_kv_pool_counts_every_ranks_heads(kv_heads, tp, held_heads):
    config = EngineConfig(model="unused", dtype="float32", num_kv_blocks=10, tensor_parallel_size=tp)
    assert kv_pool_bytes(config, hf(kv_heads)) == 10 * block_bytes(held_heads)


def test_a_memory_sized_pool_stays_within_its_size_with_replicated_heads():
    config = EngineConfig(model="unused", dtype="float32", kv_cache_memory=1 << 20, tensor_parallel_size=4)
    pool = kv_pool_bytes(config, hf(1))
    assert (1 << 20) - block_bytes(4) < pool <= 1 << 20
