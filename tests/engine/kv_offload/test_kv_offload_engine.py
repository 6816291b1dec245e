"""KV offload on the real default model: restored KV is bit-exact (CPU and disk tier, float32 and
bfloat16, full and partial prefix), greedy output is the same with offload on and off even when
the engine's pool evicts every prefix, and a request reports the tokens LMCache gave it. Each
fault costs a recompute and a counted warning, never a wrong token: test_kv_offload_faults.py;
the restart test (a new process on the same folder): test_kv_offload_restart.py.
"""

from __future__ import annotations

import pytest

from pagedserve.engine.request.request import Request
from tests.engine.kv_offload.offload_helpers import (  # noqa: F401 -- prompts, reference, tokenizer: fixtures
    BLOCK,
    CHUNK,
    GREEDY,
    NUM_BLOCKS,
    assert_same_kv,
    evict_pool,
    greedy,
    make_llm,
    pool_kv,
    prompts,
    reference,
    tokenizer,
)

pytestmark = pytest.mark.slow


# -- bit-exact restore --------------------------------------------------------------------------


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_restored_kv_is_bit_exact(default_model_dir, prompts, tmp_path, dtype):
    p, q = prompts["p"], prompts["q"]
    full = (len(p) - 1) // BLOCK * BLOCK  # whole chunks + the tail in whole blocks; 1 token computed
    shared = 150 // CHUNK * CHUNK  # q shares 150 tokens with p: 2 whole chunks
    llm = make_llm(default_model_dir, tmp_path / "kv", dtype=dtype)
    try:
        greedy(llm, p)
        ref, n = pool_kv(llm, p)  # computed directly
        assert n >= full
        # CPU tier, full hit.
        evict_pool(llm)
        assert pool_kv(llm, p)[1] == 0
        greedy(llm, p)
        assert_same_kv(pool_kv(llm, p)[0], ref, full)
        assert llm.engine.kv_offload_stats()["hit_tokens_cpu"] == full
        # CPU tier, partial prefix (q's own chunks after the shared ones are not in LMCache).
        evict_pool(llm)
        greedy(llm, q)
        assert_same_kv(pool_kv(llm, q)[0], ref, shared)
        stats = llm.engine.kv_offload_stats()
        assert stats["hit_tokens_cpu"] == full + shared and stats["hit_tokens_disk"] == 0
        assert stats["faults"] == 0
    finally:
        llm.shutdown()
    # Disk tier: a new engine (empty CPU tier) on the same folder. r shares one chunk with p
    # (partial prefix), then p comes back whole.
    r = prompts["r"]
    llm = make_llm(default_model_dir, tmp_path / "kv", dtype=dtype)
    try:
        greedy(llm, r)
        assert_same_kv(pool_kv(llm, r)[0], ref, CHUNK)
        assert llm.engine.kv_offload_stats()["hit_tokens_disk"] == CHUNK
        evict_pool(llm)
        greedy(llm, p)
        assert_same_kv(pool_kv(llm, p)[0], ref, full)
        stats = llm.engine.kv_offload_stats()
        # LMCache also keeps chunks read from disk in its CPU tier: p's first chunk may come
        # from there the second time; the others come from disk.
        assert stats["hit_tokens"] == CHUNK + full and stats["hit_tokens_disk"] >= full, stats
        assert stats["faults"] == 0
    finally:
        llm.shutdown()


# -- same greedy output -------------------------------------------------------------------------


def test_greedy_output_equal_with_offload_on_and_off(default_model_dir, prompts, reference, tmp_path):
    llm = make_llm(default_model_dir, tmp_path / "kv")
    try:
        names = list(prompts)
        # One batch that does not fit the pool at once (preemptions), then each prompt alone
        # after the pool was emptied: every prefix comes back from LMCache.
        outs = llm.generate([prompts[n] for n in names], GREEDY)
        assert {n: o.outputs[0].token_ids for n, o in zip(names, outs)} == reference
        for name in names:
            evict_pool(llm)
            assert greedy(llm, prompts[name]) == reference[name], name
        stats = llm.engine.kv_offload_stats()
        assert stats["hit_tokens"] >= 2 * (len(prompts["p"]) // CHUNK * CHUNK)
        assert stats["faults"] == 0 and stats["stored_tokens"] > 0
        engine = llm.engine
        assert not engine.has_unfinished_requests()
        assert engine.kv_manager.pool.get_num_free_blocks() == NUM_BLOCKS
    finally:
        llm.shutdown()


def test_request_reports_tokens_from_lmcache(default_model_dir, prompts, tmp_path):
    llm = make_llm(default_model_dir, tmp_path / "kv")
    try:
        p = prompts["p"]
        greedy(llm, p)
        evict_pool(llm)
        engine = llm.engine
        request = Request("r1", list(p), GREEDY)
        engine.add_request(request)
        outputs = []
        while engine.has_unfinished_requests():
            outputs += engine.step()
        assert request.num_external_cached_tokens == (len(p) - 1) // BLOCK * BLOCK
        assert {o.num_external_cached_tokens for o in outputs} == {request.num_external_cached_tokens}
        assert [t for o in outputs for t in o.new_token_ids] == greedy(llm, p)
        evict_pool(llm)  # the offline API's outputs carry the same count (the server's timings show it)
        (out,) = llm.generate([list(p)], GREEDY)
        assert out.num_external_cached_tokens == request.num_external_cached_tokens
    finally:
        llm.shutdown()
