"""KV offload without the model: settings and their errors, the disk budget, the scheduler's
load path (exact computed counts and prefix-cache withdrawal on a short load), and the LMCache
connector round trip on small synthetic KV caches (bit-exact, CPU tier and disk tier, salts)."""

from __future__ import annotations

import os

import pytest
import torch

from pagedserve.engine.attention.kv_dtype import KVCacheDtype
from pagedserve.engine.attention.kv_quant import quantize_kv
from pagedserve.engine.config.engine import EngineConfig
from pagedserve.engine.config.kv_offload import KVOffloadConfig, merge_kv_offload
from pagedserve.engine.kv_offload.disk import DiskBudget
from pagedserve.engine.model.model_config import ModelConfig, ModelConfigError
from pagedserve.engine.scheduler.output import ModelRunnerOutput
from pagedserve.engine.scheduler.scheduler import Scheduler
from tests.engine.kv_helpers import make_manager, make_request

# -- settings -------------------------------------------------------------------------------


def test_defaults_are_filled_and_paths_made_absolute(tmp_path):
    cfg = EngineConfig(model="m", kv_offload={"disk_path": str(tmp_path / "kv"), "disk_size_gb": 2})
    assert cfg.kv_offload.as_dict() == {
        "cpu_size_gb": 1.0,
        "disk_path": str(tmp_path / "kv"),
        "disk_size_gb": 2.0,
        "chunk_size": 256,
        "remote_url": None,
    }
    assert cfg.kv_offload_config.chunk_size == 256
    assert EngineConfig(model="m").kv_offload_config is None


@pytest.mark.parametrize(
    "options, message",
    [
        ({"cpu_size_gb": 0}, "kv_offload.cpu_size_gb: must be > 0.0, got 0"),
        ({"cpu_size_gb": "1"}, 'kv_offload.cpu_size_gb: must be a number, got "1"'),
        ({"disk_path": "/tmp/x"}, "kv_offload.disk_size_gb: is required with kv_offload.disk_path"),
        ({"disk_size_gb": 4}, "kv_offload.disk_size_gb: is set but kv_offload.disk_path is not"),
        ({"disk_path": "/tmp/x", "disk_size_gb": -1}, "kv_offload.disk_size_gb: must be > 0.0, got -1"),
        ({"chunk_size": 100}, "kv_offload.chunk_size: must be a multiple of block_size=16, got 100"),
        ({"chunk_size": 0}, "kv_offload.chunk_size: must be >= 1, got 0"),
        ({"cpu_gb": 1}, "kv_offload: unknown field 'cpu_gb'"),
        ([1], "kv_offload: must be an object or null, got \\[1\\]"),
    ],
)
def test_invalid_settings_name_the_key(options, message):
    with pytest.raises(ValueError, match="^" + message.replace("(", r"\(")):
        EngineConfig(model="m", kv_offload=options)


def test_disk_path_that_is_a_file_is_refused(tmp_path):
    f = tmp_path / "file"
    f.write_text("x")
    with pytest.raises(ValueError, match="exists and is not a folder"):
        KVOffloadConfig(disk_path=str(f), disk_size_gb=1)


def test_model_config_handler_kv_offload():
    ok = ModelConfig(handler={"kv_offload": {"cpu_size_gb": 2, "disk_path": "/tmp/kv", "disk_size_gb": 4}})
    assert ok.resolved()["handler"]["kv_offload"] == {
        "cpu_size_gb": 2.0,
        "disk_path": "/tmp/kv",
        "disk_size_gb": 4.0,
        "chunk_size": 256,
        "remote_url": None,
    }
    assert ModelConfig().resolved()["handler"]["kv_offload"] is None
    with pytest.raises(ModelConfigError, match=r"handler\.kv_offload\.cpu_size_gb: must be > 0.0, got 0"):
        ModelConfig(handler={"kv_offload": {"cpu_size_gb": 0}})
    with pytest.raises(ModelConfigError, match=r"handler\.kv_offload: must be an object or null, got 3"):
        ModelConfig(handler={"kv_offload": 3})


def test_server_defaults_merge_key_by_key():
    defaults = {"cpu_size_gb": 4, "disk_path": "/d", "disk_size_gb": 10}
    assert merge_kv_offload(defaults, None) == defaults
    assert merge_kv_offload(defaults, {"cpu_size_gb": 1}) == {**defaults, "cpu_size_gb": 1}
    assert merge_kv_offload(None, None) is None
    assert merge_kv_offload(None, {"cpu_size_gb": 1}) == {"cpu_size_gb": 1}


# -- disk budget ----------------------------------------------------------------------------


def test_disk_budget_prunes_oldest_files_first(tmp_path):
    for i in range(5):
        p = tmp_path / f"c{i}.data"
        p.write_bytes(b"x" * 100)
        os.utime(p, (1000 + i, 1000 + i))
    (tmp_path / "other.txt").write_bytes(b"y" * 1000)  # not a chunk file: never counted or deleted
    budget = DiskBudget(tmp_path, limit_bytes=500)
    assert budget.estimate == 500
    assert budget.account(100) == 2  # 600 > 500: prune to 90 % of the budget with room for 100
    assert sorted(p.name for p in tmp_path.iterdir()) == ["c2.data", "c3.data", "c4.data", "other.txt"]


# -- scheduler load path (a stand-in tier, no LMCache: this tests the scheduler's bookkeeping) --


class StandInTier:
    """Offers `offer` tokens past the engine's hit and restores `restore` of them."""

    def __init__(self, offer: int, restore: int) -> None:
        self.offer, self.restore = offer, restore
        self.loads: list[tuple[str, list[int], int, int]] = []
        self.forgotten: list[str] = []

    def lookup(self, request, num_computed):
        return self.offer if not self.loads else 0

    def load(self, request, block_ids, start, end):
        self.loads.append((request.request_id, list(block_ids), start, end))
        return self.restore

    def forget(self, request_id):
        self.forgotten.append(request_id)


def _scheduler(tier, budget=64):
    return Scheduler(make_manager(16), budget, 8, 64, kv_offload=tier)


def test_full_load_counts_as_computed_and_publishes_blocks():
    tier = StandInTier(offer=8, restore=8)
    s = _scheduler(tier)
    a = make_request(list(range(10)), request_id="a", max_tokens=1)
    s.add_request(a)
    out = s.schedule()
    assert tier.loads == [("a", [0, 1, 2], 0, 8)]
    assert out.num_scheduled_tokens == {"a": 2} and out.new_requests[0].num_computed_tokens == 8
    assert a.num_external_cached_tokens == 8 and a.num_cached_tokens == 0
    assert sorted(b.block_id for b in s.kv.pool.cached.values()) == [0, 1]
    res = s.update_from_output(out, ModelRunnerOutput({"a": [5]}))
    assert res[0].num_external_cached_tokens == 8 and res[0].finished
    assert tier.forgotten == ["a"]


def test_short_load_counts_only_restored_tokens_and_withdraws_the_rest():
    tier = StandInTier(offer=8, restore=4)  # the second block never arrived
    s = _scheduler(tier)
    a = make_request(list(range(10)), request_id="a", max_tokens=1)
    s.add_request(a)
    out = s.schedule()
    assert out.num_scheduled_tokens == {"a": 6} and out.new_requests[0].num_computed_tokens == 4
    assert a.num_external_cached_tokens == 4
    # Block 1 is published again: this step computes it. Nothing unfilled stays published.
    assert sorted(b.block_id for b in s.kv.pool.cached.values()) == [0, 1]
    tier2 = StandInTier(offer=8, restore=0)
    s2 = _scheduler(tier2, budget=2)  # the budget reaches only 2 tokens past the restored part
    b = make_request(list(range(10)), request_id="b", max_tokens=1)
    s2.add_request(b)
    out = s2.schedule()
    assert out.num_scheduled_tokens == {"b": 2} and out.new_requests[0].num_computed_tokens == 0
    assert s2.kv.pool.cached == {}  # no block is full after this step: none may be published
    assert s2.kv.get_block_ids("b") == [0, 1, 2]  # allocated for the planned range: still enough


# -- connector + LMCache on synthetic caches ----------------------------------------------------

L, NB, BS, H, D, C = 3, 48, 16, 2, 8, 64


def _manager(tmp_path, kv, disk=True):
    from pagedserve.engine.kv_offload.manager import KVOffloadManager

    options = {"cpu_size_gb": 0.01, "chunk_size": C}
    if disk:
        options |= {"disk_path": str(tmp_path / "kv"), "disk_size_gb": 0.05}
    return KVOffloadManager(KVOffloadConfig.from_options(options, BS), kv, BS, "unit-model")


class _Step:
    def __init__(self, rid):
        self.num_scheduled_tokens = {rid: 1}


def _store(mgr, request, blocks):
    request.num_computed_tokens = request.num_tokens
    mgr.store_computed(_Step(request.request_id), {request.request_id: request}, lambda rid: blocks)
    assert mgr.flush()


def _cache(dtype) -> torch.Tensor:
    """A layer's paged KV tensor: float, or a quantized KV cache's uint8 rows (codes + scale)."""
    values = torch.randn(2, NB, BS, H, D)
    return quantize_kv(values, KVCacheDtype(dtype)) if isinstance(dtype, str) else values.to(dtype)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, "fp8_e4m3"])
def test_round_trip_is_bit_exact_from_cpu_and_disk(tmp_path, dtype):
    torch.manual_seed(0)
    kv = [_cache(dtype) for _ in range(L)]
    ref = [k.clone() for k in kv]
    prompt = list(range(1000, 1000 + 200))  # 3 full chunks of 64 + 8 tokens
    mgr = _manager(tmp_path, kv)
    try:
        _store(mgr, make_request(prompt, request_id="a"), list(range(13)))
        assert mgr.stats.stored_tokens == 192 and len(list((tmp_path / "kv").glob("*.data"))) == 3
        # Full hit into fresh blocks 20..32; partial hit (shared 150 tokens) from block 2 on.
        b = make_request(prompt + [7], request_id="b")
        assert mgr.lookup(b, 0) == 192
        assert mgr.load(b, list(range(20, 33)), 0, 192) == 192
        c = make_request(prompt[:150] + [1] * 60, request_id="c")
        assert mgr.lookup(c, 32) == 128 - 32  # chunks 0-1 match; the first 2 blocks are the engine's
        assert mgr.load(c, [0, 1] + list(range(40, 46)), 32, 128) == 96
        for k, r in zip(kv, ref):
            assert torch.equal(k[:, 20:32], r[:, 0:12])
            assert torch.equal(k[:, 40:46], r[:, 2:8])
        assert mgr.stats.hit_tokens_cpu == 288 and mgr.stats.hit_tokens_disk == 0
    finally:
        mgr.close()
    # A new LMCache (empty CPU tier) on the same folder: hits come from disk.
    for k in kv:
        k.zero_()
    mgr = _manager(tmp_path, kv)
    try:
        d = make_request(prompt[:140] + [3] * 10, request_id="d")
        assert mgr.lookup(d, 0) == 128
        assert mgr.load(d, list(range(10, 20)), 0, 128) == 128
        for k, r in zip(kv, ref):
            assert torch.equal(k[:, 10:18], r[:, 0:8])
        assert mgr.stats.hit_tokens_disk == 128 and mgr.stats.faults == 0
    finally:
        mgr.close()


def test_prompt_tail_is_stored_in_whole_blocks(tmp_path):
    torch.manual_seed(1)
    kv = [torch.randn(2, NB, BS, H, D) for _ in range(L)]
    ref = [k.clone() for k in kv]
    mgr = _manager(tmp_path, kv)
    try:
        prompt = list(range(2000, 2000 + 150))  # 2 whole chunks; the tail [128, 144) is 1 block
        a = make_request(prompt, request_id="a")
        a.num_computed_tokens = 100  # mid-prefill: only the first whole chunk is complete
        mgr.store_computed(_Step("a"), {"a": a}, lambda rid: list(range(10)))
        assert mgr.stats.stored_tokens == 64
        _store(mgr, a, list(range(10)))  # prefill done: chunk 2 and the tail, never chunk 1 again
        assert (mgr.stats.stored_tokens, mgr.stats.stored_chunks) == (144, 3)
        assert len(list((tmp_path / "kv").glob("*.data"))) == 3
        b = make_request(prompt, request_id="b")  # the same prompt: all but its last block
        assert mgr.lookup(b, 0) == 144
        assert mgr.load(b, list(range(30, 40)), 0, 144) == 144
        longer = make_request(prompt + [5] * 40, request_id="c")  # the tail is no whole chunk of it
        assert mgr.lookup(longer, 0) == 128
        mgr.forget("c")
        for k, r in zip(kv, ref):
            assert torch.equal(k[:, 30:39], r[:, 0:9])
    finally:
        mgr.close()


def test_cache_salt_separates_keys(tmp_path):
    kv = [torch.randn(2, NB, BS, H, D) for _ in range(L)]
    mgr = _manager(tmp_path, kv, disk=False)
    try:
        prompt = list(range(500, 600))
        _store(mgr, make_request(prompt, request_id="a", cache_salt="tenant-1"), list(range(7)))
        assert mgr.lookup(make_request(prompt, request_id="b", cache_salt="tenant-2"), 0) == 0
        assert mgr.lookup(make_request(prompt, request_id="c"), 0) == 0
        assert mgr.lookup(make_request(prompt, request_id="d", cache_salt="tenant-1"), 0) == 96
    finally:
        mgr.close()


def test_chunk_keys_are_the_prefix_cache_block_hashes(tmp_path):
    """LMCache's keys for a prompt come from the prefix cache's own `hash_block` (SHA-256): the
    first chunk chains from its seeded root, later chunks from the previous hash's first 8
    bytes (LMCache carries the chain as a 64-bit int). Model and salt stay in the key."""
    from pagedserve.engine.kv_cache.hashing import BlockHash, hash_block, root_hash, sha256

    kv = [torch.zeros(2, NB, BS, H, D) for _ in range(L)]
    mgr = _manager(tmp_path, kv, disk=False)
    try:
        prompt = list(range(300, 300 + 2 * C))
        keys = [key for _, _, key in mgr.engine.token_database.process_tokens(tokens=prompt)]
        first = hash_block(sha256, root_hash(sha256), prompt[:C])
        second = hash_block(sha256, BlockHash(first[:8]), prompt[C:])
        assert [k.chunk_hash for k in keys] == [int.from_bytes(h[:8], "big") for h in (first, second)]
        assert keys[0].model_name == "unit-model"
        salted = mgr.engine.token_database.process_tokens(tokens=prompt, request_configs={"lmcache.tag.salt": "s"})
        assert next(iter(salted))[2] != keys[0]
    finally:
        mgr.close()
