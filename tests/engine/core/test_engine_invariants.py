"""After many requests — finished, aborted, preempted — every block is free again and the
prefix cache map is consistent. Runs the real EngineCore on a tiny random-weight Llama."""

from __future__ import annotations

import random

import pytest

from pagedserve.engine.config.engine import EngineConfig
from pagedserve.engine.core.engine_core import EngineCore
from pagedserve.engine.request.request import Request
from pagedserve.engine.sampling.params import SamplingParams

NUM_BLOCKS = 40
BLOCK_SIZE = 4


def check_pool_consistency(engine: EngineCore) -> None:
    pool = engine.kv_manager.pool
    refs = [0] * pool.num_blocks
    for blocks in engine.kv_manager.req_to_blocks.values():
        for b in blocks:
            refs[b.block_id] += 1
    assert [b.ref_cnt for b in pool.blocks] == refs
    free_ids = pool.free_queue.block_ids()
    assert sorted(free_ids) == [i for i, r in enumerate(refs) if r == 0]
    for block_hash, block in pool.cached.items():
        assert block.block_hash == block_hash and block.token_ids is not None


@pytest.mark.parametrize(
    ("caching", "speculative"),
    [
        (True, None),
        (False, None),
        (True, {"num_speculative_tokens": 3}),
        (True, {"method": "suffix", "num_speculative_tokens": 8, "suffix_spec_factor": 8.0}),
        (True, {"method": "draft", "num_speculative_tokens": 2, "draft_model": "tiny"}),
    ],
    ids=["caching", "no-caching", "speculative", "suffix", "draft-model"],
)
def test_random_workload_leaves_every_block_free(tiny_model_dir, caching, speculative):
    if speculative and speculative.get("draft_model") == "tiny":
        speculative = {**speculative, "draft_model": str(tiny_model_dir)}
    engine = EngineCore(
        EngineConfig(
            model=str(tiny_model_dir),
            num_kv_blocks=NUM_BLOCKS,
            block_size=BLOCK_SIZE,
            max_num_batched_tokens=24,
            max_num_seqs=6,
            enable_prefix_caching=caching,
            max_model_len=96,
            speculative=speculative,
        )
    )
    rng = random.Random(1234)
    shared_prefix = [rng.randrange(64) for _ in range(12)]
    submitted, finished = 0, set()
    live: list[str] = []
    for _step in range(300):
        if submitted < 80 and rng.random() < 0.5:
            prefix = shared_prefix[: rng.randrange(13)] if rng.random() < 0.6 else []
            prompt = prefix + [rng.randrange(64) for _ in range(rng.randrange(1, 30))]
            params = SamplingParams(
                max_tokens=rng.randrange(1, 20), temperature=rng.choice([0.0, 1.0]), seed=submitted, ignore_eos=True
            )
            req_id = f"r{submitted}"
            engine.add_request(Request(req_id, prompt, params))
            live.append(req_id)
            submitted += 1
        if live and rng.random() < 0.1:
            victim = live.pop(rng.randrange(len(live)))
            engine.abort_requests([victim])
            finished.add(victim)
        for out in engine.step():
            if out.finished:
                finished.add(out.request_id)
                live.remove(out.request_id)
        check_pool_consistency(engine)
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.finished:
                finished.add(out.request_id)
        check_pool_consistency(engine)
    engine.step()  # lets the runner forget the last finished requests
    assert len(finished) == submitted == 80
    assert engine.scheduler.num_preemptions > 0
    if speculative:  # drafts were verified, some kept and some refused
        assert 0 < engine.scheduler.num_accepted_tokens < engine.scheduler.num_draft_tokens
    pool = engine.kv_manager.pool
    assert pool.get_num_free_blocks() == NUM_BLOCKS
    assert all(b.ref_cnt == 0 for b in pool.blocks)
    assert not engine.kv_manager.req_to_blocks and not engine.runner.requests
    if speculative and engine.drafter.draft_model is not None:  # the draft pool is all free too
        assert engine.drafter.draft_model.num_free_blocks == engine.drafter.draft_model.num_blocks
    if caching:
        assert engine.kv_manager.num_hit_tokens > 0
        # Every surviving hash still names the tokens its block holds; reused blocks lost theirs.
        hashed = [b for b in pool.blocks if b.block_hash is not None]
        assert len(hashed) == len(pool.cached) and pool.num_evictions > 0
    else:
        assert not pool.cached


def _run_to_end(engine: EngineCore, requests: list[Request]) -> dict[str, list[int]]:
    for r in requests:
        engine.add_request(r)
    tokens: dict[str, list[int]] = {r.request_id: [] for r in requests}
    while engine.has_unfinished_requests():
        for out in engine.step():
            tokens[out.request_id].extend(out.new_token_ids)
    return tokens


def test_seeded_sampling_is_unchanged_by_preemption(tiny_model_dir):
    def engine(num_blocks: int) -> EngineCore:
        return EngineCore(
            EngineConfig(
                model=str(tiny_model_dir),
                num_kv_blocks=num_blocks,
                block_size=BLOCK_SIZE,
                enable_prefix_caching=False,
                max_model_len=32,
            )
        )

    def seeded() -> Request:
        return Request(
            "seeded", [5, 6, 7, 8, 9, 10], SamplingParams(max_tokens=10, temperature=1.0, seed=42, ignore_eos=True)
        )

    alone = _run_to_end(engine(64), [seeded()])["seeded"]
    crowded = engine(8)
    first = Request("first", list(range(20, 30)), SamplingParams(max_tokens=14, temperature=0, ignore_eos=True))
    together = _run_to_end(crowded, [first, seeded()])
    assert crowded.scheduler.num_preemptions > 0
    assert together["seeded"] == alone and len(alone) == 10
