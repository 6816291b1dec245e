"""KVCacheManager on tiny pools (block_size 4): hits, lazy rescue, eviction order, salts."""

from __future__ import annotations

import pytest

from pagedserve.engine.config.engine import PrefixCacheHash
from tests.engine.kv_helpers import make_manager, make_request

KINDS = list(PrefixCacheHash)


def _hit_ids(mgr, req):
    hits, n = mgr.get_computed_blocks(req)
    return hits.block_ids()[0], n


def _run_prompt(mgr, req):
    """Schedule the whole prompt of a fresh request the way the scheduler does."""
    hits, n = mgr.get_computed_blocks(req)
    req.num_computed_tokens = n
    new = mgr.allocate_slots(req, req.num_tokens - n, hits)
    assert new is not None
    req.num_computed_tokens = req.num_tokens
    return hits, new


@pytest.mark.parametrize("kind", KINDS)
def test_allocate_and_cache_full_blocks(kind):
    mgr = make_manager(10, hash_kind=kind)
    req = make_request(list(range(10)))  # 2 full blocks + 2 tokens
    hits, new = _run_prompt(mgr, req)
    assert hits.block_ids() == ([],) and new.block_ids()[0] == [0, 1, 2]
    assert [b.ref_cnt for b in new.groups[0]] == [1, 1, 1]
    assert new.groups[0][0].block_hash == req.block_hashes[0] and new.groups[0][1].block_hash == req.block_hashes[1]
    assert new.groups[0][2].block_hash is None  # partial block is never cached
    assert mgr.pool.free_queue.block_ids() == [3, 4, 5, 6, 7, 8, 9]


@pytest.mark.parametrize("kind", KINDS)
def test_prefix_hit_shares_blocks_and_leaves_last_token(kind):
    mgr = make_manager(10, hash_kind=kind)
    a = make_request(list(range(10)))
    _run_prompt(mgr, a)
    b = make_request(list(range(8)) + [99, 98, 97])
    hits, new = _run_prompt(mgr, b)
    assert hits.block_ids()[0] == [0, 1]
    assert [x.ref_cnt for x in hits.groups[0]] == [2, 2]
    assert new.block_ids()[0] == [3]
    assert mgr.get_block_ids(b.request_id) == [0, 1, 3]
    # A prompt that is exactly cached keeps its last block to recompute the last token.
    c = make_request(list(range(8)))
    hits, n = mgr.get_computed_blocks(c)
    assert hits.block_ids()[0] == [0] and n == 4


def test_free_in_reverse_then_lazy_rescue_and_eviction_order():
    mgr = make_manager(6)
    a = make_request(list(range(12)))  # exactly 3 full blocks
    _run_prompt(mgr, a)
    assert mgr.get_block_ids(a.request_id) == [0, 1, 2]
    mgr.free(a)
    # Tail first: block 2 (end of the prompt) is evicted before block 0 (its head).
    assert mgr.pool.free_queue.block_ids() == [3, 4, 5, 2, 1, 0]
    assert all(b.ref_cnt == 0 for b in mgr.pool.blocks)
    # Same prefix again: blocks 0 and 1 are rescued from the free queue.
    b = make_request(list(range(12)) + [50])
    hits, new = _run_prompt(mgr, b)
    assert hits.block_ids()[0] == [0, 1, 2]
    assert new.block_ids()[0] == [3]
    assert mgr.pool.free_queue.block_ids() == [4, 5]


def test_eviction_takes_oldest_free_and_kills_its_hash():
    mgr = make_manager(4)
    a = make_request(list(range(8)))
    _run_prompt(mgr, a)  # blocks 0, 1 (block 1 full, cached)
    mgr.free(a)
    assert mgr.pool.free_queue.block_ids() == [2, 3, 1, 0]
    b = make_request([100 + i for i in range(12)])  # needs 3 blocks: takes 2, 3, then 1
    _, new = _run_prompt(mgr, b)
    assert new.block_ids()[0] == [2, 3, 1]
    assert a.block_hashes[1] not in mgr.pool.cached
    assert mgr.pool.cached[a.block_hashes[0]].block_id == 0
    c = make_request(list(range(8)) + [1])
    hits, n = mgr.get_computed_blocks(c)
    assert hits.block_ids()[0] == [0] and n == 4


def test_allocation_failure_changes_nothing():
    mgr = make_manager(3)
    a = make_request(list(range(8)))
    _run_prompt(mgr, a)
    b = make_request([50 + i for i in range(9)])  # needs 3 blocks, 1 free
    hits, n = mgr.get_computed_blocks(b)
    assert mgr.allocate_slots(b, 9, hits) is None
    assert mgr.pool.free_queue.block_ids() == [2]
    assert b.request_id not in mgr.req_to_blocks


def test_evictable_hits_are_not_double_counted():
    mgr = make_manager(3)
    a = make_request(list(range(8)))
    _run_prompt(mgr, a)
    mgr.free(a)  # blocks 0, 1 free but cached
    b = make_request(list(range(8)) + [9, 9, 9, 9, 9])  # hits 0, 1; needs 2 more -> only 1 left
    hits, n = mgr.get_computed_blocks(b)
    b.num_computed_tokens = n
    assert hits.block_ids()[0] == [0, 1]
    assert mgr.allocate_slots(b, b.num_tokens - n, hits) is None
    assert mgr.pool.free_queue.block_ids() == [2, 1, 0] and all(x.ref_cnt == 0 for x in hits.groups[0])


@pytest.mark.parametrize("kind", KINDS)
def test_cache_salt_isolates_tenants(kind):
    mgr = make_manager(10, hash_kind=kind)
    a = make_request(list(range(9)), cache_salt="tenant-a")
    _run_prompt(mgr, a)
    b = make_request(list(range(9)), cache_salt="tenant-b")
    assert _hit_ids(mgr, b) == ([], 0)
    c = make_request(list(range(9)))
    assert _hit_ids(mgr, c) == ([], 0)
    d = make_request(list(range(9)), cache_salt="tenant-a")
    hits, n = mgr.get_computed_blocks(d)
    assert hits.block_ids()[0] == [0, 1] and n == 8


def test_decode_caches_block_when_it_fills():
    mgr = make_manager(4)
    a = make_request([1, 2, 3])
    _run_prompt(mgr, a)
    a.append_output_token_ids([4])
    mgr.allocate_slots(a, 1)
    a.num_computed_tokens += 1
    assert mgr.pool.blocks[0].block_hash == a.block_hashes[0]
    a.append_output_token_ids([5])
    new = mgr.allocate_slots(a, 1)
    assert new.block_ids()[0] == [1]


def test_caching_off_never_hits():
    mgr = make_manager(6, enable_caching=False)
    a = make_request(list(range(8)))
    _run_prompt(mgr, a)
    assert not mgr.pool.cached
    assert _hit_ids(mgr, make_request(list(range(9)))) == ([], 0)


def test_hit_rate_counts_tokens():
    mgr = make_manager(8)
    _run_prompt(mgr, make_request(list(range(8))))
    _run_prompt(mgr, make_request(list(range(8)) + [1, 2, 3, 4]))
    assert mgr.num_queried_tokens == 20 and mgr.num_hit_tokens == 8
    assert mgr.prefix_cache_hit_rate == pytest.approx(0.4)
