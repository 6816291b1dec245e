"""The hybrid KV cache on tiny pools (block_size 4): a full-attention group and a sliding-window
group (w = 8) over one block pool; exact block ids (-1: the null block of a dropped position)."""

from __future__ import annotations

from pagedserve.engine.kv_cache.groups import KVCacheGroupSpec, plan_layout
from pagedserve.engine.kv_cache.hashing import get_hash_fn
from pagedserve.engine.kv_cache.manager import KVCacheManager
from tests.engine.kv_helpers import make_request

W = 8
GROUPS = (KVCacheGroupSpec(None, (0,)), KVCacheGroupSpec(W, (1,)))


def _manager(num_blocks: int) -> KVCacheManager:
    return KVCacheManager(num_blocks, 4, get_hash_fn("sha256"), groups=GROUPS)


def _prefill(mgr, req):
    hits, n = mgr.get_computed_blocks(req)
    req.num_computed_tokens = n
    new = mgr.allocate_slots(req, req.num_tokens - n, hits)
    assert new is not None
    req.num_computed_tokens = req.num_tokens
    return hits, new


def _decode(mgr, req, token):
    req.append_output_token_ids([token])
    new = mgr.allocate_slots(req, 1)
    assert new is not None
    req.num_computed_tokens += 1
    return new


def test_layouts():
    gemma3 = plan_layout([None if (i + 1) % 6 == 0 else 512 for i in range(18)])
    assert gemma3.num_tensors == 3
    assert [(g.window, g.layers) for g in gemma3.groups] == [
        (None, (5, 11, 17)),
        (512, (0, 1, 2)),
        (512, (3, 4, 6)),
        (512, (7, 8, 9)),
        (512, (10, 12, 13)),
        (512, (14, 15, 16)),
    ]
    assert gemma3.tensor_of_layer()[:7] == [0, 1, 2, 0, 1, 0, 2]
    gemma2 = plan_layout([4096, None, 4096, None])
    assert [(g.window, g.layers) for g in gemma2.groups] == [(None, (1, 3)), (4096, (0, 2))]
    assert gemma2.num_tensors == 2
    # 3 sliding, 1 full (the engine test's Gemma 3): groups of one layer.
    assert plan_layout([12, 12, None, 12]).num_tensors == 1
    # One kind: one group of every layer, the layout before the hybrid cache.
    llama = plan_layout([None] * 4)
    assert not llama.is_hybrid and llama.num_tensors == 4 and llama.groups[0].layers == (0, 1, 2, 3)
    mistral = plan_layout([12] * 2)
    assert mistral.is_hybrid and mistral.groups == (KVCacheGroupSpec(12, (0, 1)),)
    off = plan_layout([512, None, 512, None], hybrid=False)
    assert off.groups == (KVCacheGroupSpec(None, (0, 1, 2, 3)),) and off.num_tensors == 4
    # One 4,096-token sequence: every block of the full group; in chunks of 64, the window's
    # 31 tokens before a chunk and the chunk (95 tokens: 6 blocks, + 1 where they straddle).
    assert plan_layout([32, None]).blocks_for_one_sequence(4096, 16, 64) == 256 + 7
    assert gemma2.blocks_for_one_sequence(4096, 16, 1) == 2 * 256  # a window as long as the sequence


def test_sliding_group_returns_blocks_its_window_left():
    mgr = _manager(16)
    req = make_request(list(range(10)))
    _, new = _prefill(mgr, req)
    assert new.block_ids() == ([0, 1, 2], [3, 4, 5])
    _decode(mgr, req, 10)  # next query at 10 sees 3..10: block 0 is still needed
    assert mgr.get_group_block_ids(req.request_id) == ([0, 1, 2], [3, 4, 5])
    _decode(mgr, req, 11)  # the query at 11 sees 4..11: block 0 (positions 0..3) is returned
    assert mgr.get_group_block_ids(req.request_id) == ([0, 1, 2], [-1, 4, 5])
    assert mgr.pool.free_queue.block_ids()[-1] == 3
    new = _decode(mgr, req, 12)  # position 12 opens block 3 in both groups
    assert new.block_ids() == ([6], [7])
    assert mgr.get_group_block_ids(req.request_id) == ([0, 1, 2, 6], [-1, 4, 5, 7])
    mgr.free(req)
    assert mgr.pool.get_num_free_blocks() == 16 and not mgr.req_to_blocks


def test_blocks_held_stay_within_the_window_while_the_full_group_holds_all():
    mgr = _manager(40)
    req = make_request([7] * 5)
    _prefill(mgr, req)
    for step in range(60):
        _decode(mgr, req, step)
        mgr.remove_skipped_blocks(req)  # after the step, as the scheduler does
        full, sliding = mgr.groups
        assert full.num_held_blocks(req.request_id) == -(-req.num_computed_tokens // 4)
        assert sliding.num_held_blocks(req.request_id) <= -(-W // 4) + 1
    # 65 tokens: the next query sees 58..65, in blocks 14 (56..59), 15 and 16 (64..67).
    assert sliding.num_held_blocks(req.request_id) == 3
    assert mgr.get_group_block_ids(req.request_id)[1][:14] == [-1] * 14
    assert mgr.pool.get_num_free_blocks() == 40 - 17 - 3


def test_same_prompt_hits_every_group():
    mgr = _manager(16)
    a = make_request(list(range(17)))
    _, new = _prefill(mgr, a)
    assert new.block_ids() == ([0, 1, 2, 3, 4], [5, 6, 7, 8, 9])
    mgr.remove_skipped_blocks(a)  # the next query (at 17) sees 10..17: blocks 0, 1 go back
    assert mgr.get_group_block_ids(a.request_id)[1] == [-1, -1, 7, 8, 9]
    mgr.free(a)
    b = make_request(list(range(17)))
    hits, n = mgr.get_computed_blocks(b)
    # 4 blocks (16 tokens): every full block; the window of the query at 16 (9..16): blocks 2, 3.
    assert n == 16 and hits.block_ids() == ([0, 1, 2, 3], [-1, -1, 7, 8])
    assert [g.num_hit_blocks for g in mgr.groups] == [4, 2]
    b.num_computed_tokens = n
    new = mgr.allocate_slots(b, 1, hits)
    # The free queue was [10..15, 5, 6 (the window left them), 4, 3, 2, 1, 0, 9, 8, 7 (a freed, tails first)].
    assert new.block_ids() == ([10], [11])
    assert mgr.get_group_block_ids(b.request_id) == ([0, 1, 2, 3, 10], [-1, -1, 7, 8, 11])


def test_a_missing_window_block_shortens_the_hit_in_every_group():
    mgr = _manager(16)
    a = make_request(list(range(17)))
    _prefill(mgr, a)
    mgr.free(a)
    mgr.pool.uncache_block(mgr.pool.blocks[8])  # the sliding group's block 3 (positions 12..15)
    b = make_request(list(range(17)))
    hits, n = mgr.get_computed_blocks(b)
    # L = 4 needs sliding blocks 2, 3; L = 3 (the query at 12 sees 5..12) needs 1, 2: cached.
    assert n == 12 and hits.block_ids() == ([0, 1, 2], [-1, 6, 7])
    mgr.pool.uncache_block(mgr.pool.blocks[6])  # sliding block 1: L = 3 and L = 2 (sees 1..8) fail
    c = make_request(list(range(17)))
    hits, n = mgr.get_computed_blocks(c)
    assert n == 4 and hits.block_ids() == ([0], [5])


def test_allocation_counts_every_group_and_changes_nothing_when_short():
    mgr = _manager(5)
    a = make_request(list(range(9)))  # 3 blocks per group: 6 > 5
    hits, n = mgr.get_computed_blocks(a)
    assert mgr.allocate_slots(a, 9, hits) is None
    assert mgr.pool.get_num_free_blocks() == 5 and not mgr.req_to_blocks
    b = make_request(list(range(8)))
    _, new = _prefill(mgr, b)
    assert new.block_ids() == ([0, 1], [2, 3])


def test_longest_sequence_a_pool_holds():
    llama = plan_layout([None] * 2)
    assert llama.longest_sequence(32, 4, 24, 130) == 128  # 32 blocks of 4 tokens
    hybrid = plan_layout([8, None])
    # 32 blocks: n tokens need cdiv(n, 4) full blocks + cdiv(8 - 1 + 24, 4) + 1 = 9 sliding ones.
    assert hybrid.longest_sequence(32, 4, 24, 1000) == 92
    assert hybrid.longest_sequence(32, 4, 24, 50) == 50
