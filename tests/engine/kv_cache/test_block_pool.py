"""Block pool and free queue: exact block ids, ref counts and eviction order on tiny pools."""

from __future__ import annotations

import pytest

from pagedserve.engine.kv_cache.block import FreeBlockQueue, KVCacheBlock
from pagedserve.engine.kv_cache.block_pool import BlockPool


def test_free_queue_remove_from_middle_and_append():
    blocks = [KVCacheBlock(i) for i in range(5)]
    q = FreeBlockQueue(blocks)
    assert q.block_ids() == [0, 1, 2, 3, 4]
    q.remove(blocks[2])
    assert q.block_ids() == [0, 1, 3, 4] and q.num_free_blocks == 4
    assert q.popleft() is blocks[0]
    q.append(blocks[2])
    q.append(blocks[0])
    assert q.block_ids() == [1, 3, 4, 2, 0]
    with pytest.raises(ValueError):
        q.append(blocks[0])  # already queued
    with pytest.raises(ValueError):
        q.remove(KVCacheBlock(9))


def test_free_queue_empty_pop():
    q = FreeBlockQueue([])
    with pytest.raises(ValueError):
        q.popleft()


def test_allocate_pops_from_head_and_sets_ref():
    pool = BlockPool(6)
    got = pool.get_new_blocks(3)
    assert [b.block_id for b in got] == [0, 1, 2]
    assert [b.ref_cnt for b in got] == [1, 1, 1]
    assert pool.free_queue.block_ids() == [3, 4, 5]
    with pytest.raises(ValueError):
        pool.get_new_blocks(4)


def test_free_appends_in_given_order_and_keeps_hash():
    pool = BlockPool(4)
    a, b, c = pool.get_new_blocks(3)
    pool.cache_full_block(a, b"h-a", (1, 2))
    pool.free_blocks([c, b, a])  # a request frees its blocks in reverse
    assert pool.free_queue.block_ids() == [3, 2, 1, 0]
    assert a.block_hash == b"h-a" and pool.get_cached_block(b"h-a", (1, 2)) is a


def test_touch_rescues_freed_cached_block():
    pool = BlockPool(3)
    (a,) = pool.get_new_blocks(1)
    pool.cache_full_block(a, b"h", (7,))
    pool.free_blocks([a])
    assert pool.free_queue.block_ids() == [1, 2, 0]
    pool.touch([a])
    assert a.ref_cnt == 1 and pool.free_queue.block_ids() == [1, 2]
    pool.touch([a])
    assert a.ref_cnt == 2
    pool.free_blocks([a])
    assert a.ref_cnt == 1 and pool.free_queue.block_ids() == [1, 2]


def test_eviction_drops_hash_only_when_memory_is_reused():
    pool = BlockPool(2)
    a, b = pool.get_new_blocks(2)
    pool.cache_full_block(a, b"ha", (1,))
    pool.cache_full_block(b, b"hb", (2,))
    pool.free_blocks([b, a])
    assert set(pool.cached) == {b"ha", b"hb"}
    (x,) = pool.get_new_blocks(1)  # head of the queue is b
    assert x is b and b.block_hash is None and b"hb" not in pool.cached
    assert pool.get_cached_block(b"ha", (1,)) is a
    assert pool.num_evictions == 1


def test_cached_hit_checks_tokens():
    pool = BlockPool(2)
    (a,) = pool.get_new_blocks(1)
    pool.cache_full_block(a, b"h", (1, 2))
    assert pool.get_cached_block(b"h", (1, 3)) is None  # same hash, other tokens: a collision


def test_second_block_with_same_hash_stays_uncached():
    pool = BlockPool(2)
    a, b = pool.get_new_blocks(2)
    pool.cache_full_block(a, b"h", (1,))
    pool.cache_full_block(b, b"h", (1,))
    assert pool.cached[b"h"] is a and b.block_hash is None


def test_double_free_is_refused():
    pool = BlockPool(2)
    (a,) = pool.get_new_blocks(1)
    pool.free_blocks([a])
    with pytest.raises(ValueError):
        pool.free_blocks([a])


def test_caching_disabled_publishes_nothing():
    pool = BlockPool(2, enable_caching=False)
    (a,) = pool.get_new_blocks(1)
    pool.cache_full_block(a, b"h", (1,))
    assert not pool.cached and a.block_hash is None


def test_reset_prefix_cache_only_when_idle():
    pool = BlockPool(2)
    (a,) = pool.get_new_blocks(1)
    pool.cache_full_block(a, b"h", (1,))
    assert pool.reset_prefix_cache() is False
    pool.free_blocks([a])
    assert pool.reset_prefix_cache() is True
    assert not pool.cached and a.block_hash is None
