"""KV offload on the real default model: restored KV is bit-exact (CPU and disk tier, float32 and
bfloat16, full and partial prefix), greedy output is the same with offload on and off even when
the engine's pool evicts every prefix, and each fault (unusable or full disk folder, deleted or
truncated chunk file, LMCache raising) costs a recompute and a counted warning, never a wrong
token. The restart test (a new process on the same folder) is in test_kv_offload_restart.py.
"""

from __future__ import annotations

import itertools

import pytest
import torch

from pagedserve.engine import LLM, SamplingParams
from pagedserve.engine.request.request import Request

pytestmark = pytest.mark.slow

CHUNK = 64
BLOCK = 16
NUM_BLOCKS = 40  # 640 tokens: one ~200-token prompt fits a few times, a filler evicts everything
GREEDY = SamplingParams(temperature=0, max_tokens=6)
_fillers = itertools.count()


def _text(n_items: int, start: int = 0) -> str:
    fruits = ["apple", "banana", "cherry", "grape", "lemon", "mango", "orange", "peach", "pear", "plum"]
    lines = [f"Item {i}: a basket holds {i % 7 + 2} {fruits[i % len(fruits)]}s." for i in range(start, start + n_items)]
    return "Inventory list.\n" + "\n".join(lines) + "\nSummary: the basket with the most fruit is"


@pytest.fixture(scope="module")
def tokenizer(default_model_dir):
    from pagedserve.engine.llm import load_tokenizer

    return load_tokenizer(default_model_dir)


@pytest.fixture(scope="module")
def prompts(tokenizer) -> dict[str, list[int]]:
    enc = lambda t: tokenizer.encode(t, add_special_tokens=False)
    p = enc(_text(16))  # 219 tokens: 3 whole chunks of 64 and a tail
    q = p[:150] + enc(" Then the list goes on: " + _text(4, start=40))
    r = p[:100] + enc(" Meanwhile, in another story, a cat sat on a mat and looked at the sea for hours.")
    items = {"p": p, "q": q, "r": r, "short": enc("1, 2, 3, 4,")}
    assert 192 < len(p) < 256 and len(q) > 192 and 128 > len(r) > 100, {k: len(v) for k, v in items.items()}
    return items


def make_llm(model_dir, disk=None, dtype="float32", cpu_size_gb=0.2, disk_size_gb=0.5, offload=True):
    options = {"cpu_size_gb": cpu_size_gb, "chunk_size": CHUNK}
    if disk is not None:
        options |= {"disk_path": str(disk), "disk_size_gb": disk_size_gb}
    return LLM(
        model_dir,
        dtype=dtype,
        num_threads=1,
        num_kv_blocks=NUM_BLOCKS,
        max_model_len=NUM_BLOCKS * BLOCK,
        max_num_batched_tokens=NUM_BLOCKS * BLOCK,
        kv_offload=options if offload else None,
    )


@pytest.fixture(scope="module")
def reference(default_model_dir, prompts) -> dict[str, list[int]]:
    """Greedy outputs with offload off (each prompt alone)."""
    llm = make_llm(default_model_dir, offload=False)
    return {name: llm.generate([ids], GREEDY)[0].outputs[0].token_ids for name, ids in prompts.items()}


def greedy(llm: LLM, ids: list[int]) -> list[int]:
    return llm.generate([ids], GREEDY)[0].outputs[0].token_ids


def evict_pool(llm: LLM) -> None:
    """Run a prompt that needs every block of the pool: no cached prefix survives."""
    n = next(_fillers)
    filler = [(1000 + 37 * n + 11 * i) % 40000 + 100 for i in range(NUM_BLOCKS * BLOCK - 2)]
    llm.generate([filler], SamplingParams(temperature=0, max_tokens=1))
    assert llm.engine.kv_manager.pool.get_num_free_blocks() == NUM_BLOCKS


def pool_kv(llm: LLM, ids: list[int]) -> tuple[list[torch.Tensor], int]:
    """KV of the full blocks of `ids` held in the engine's pool (per layer), and their tokens."""
    probe = Request("probe", list(ids) + [0], SamplingParams())
    blocks, n = llm.engine.kv_manager.get_computed_blocks(probe)
    index = torch.tensor(blocks.block_ids()[0], dtype=torch.int64)  # one KV cache group (Llama)
    return [kv[:, index].clone() for kv in llm.engine.runner.kv_caches], n


def assert_same_kv(got: list[torch.Tensor], ref: list[torch.Tensor], num_tokens: int) -> None:
    nb = num_tokens // BLOCK
    for layer, (g, r) in enumerate(zip(got, ref)):
        assert torch.equal(g[:, :nb], r[:, :nb]), f"layer {layer} differs"


def chunk_files(llm: LLM, ids: list[int], folder) -> list:
    """The disk tier's file of each chunk `ids` stores (whole chunks, then the tail), in order."""
    lmc = llm.engine.kv_offload.engine
    limit = (len(ids) - 1) // BLOCK * BLOCK
    return [
        folder / (key.to_string().replace("/", "-SEP-") + ".data")
        for _, _, key in lmc.token_database.process_tokens(tokens=ids[:limit])
    ]


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


# -- faults -------------------------------------------------------------------------------------


def test_unusable_disk_folder_falls_back_to_cpu_tier(default_model_dir, prompts, reference, tmp_path):
    blocker = tmp_path / "not-a-folder"
    blocker.write_text("a file where the folder's parent should be")
    llm = make_llm(default_model_dir, blocker / "kv")  # mkdir fails even for root
    try:
        p = prompts["p"]
        assert greedy(llm, p) == reference["p"]
        evict_pool(llm)
        assert greedy(llm, p) == reference["p"]
        stats = llm.engine.kv_offload_stats()
        assert stats["fault_kinds"] == {"disk_unwritable": 1}
        assert stats["hit_tokens_cpu"] > 0
    finally:
        llm.shutdown()


def test_disk_folder_lost_while_serving(default_model_dir, prompts, reference, tmp_path):
    folder = tmp_path / "kv"
    llm = make_llm(default_model_dir, folder)
    try:
        for f in folder.iterdir():
            f.unlink()
        folder.rmdir()
        folder.write_text("the folder is gone; writes into it fail")  # ENOTDIR, even for root
        for name in ("p", "q"):
            assert greedy(llm, prompts[name]) == reference[name]
        assert llm.engine.kv_offload.flush()
        stats = llm.engine.kv_offload_stats()
        assert stats["fault_kinds"].get("disk_write", 0) >= 3
        evict_pool(llm)
        assert greedy(llm, prompts["p"]) == reference["p"]  # the CPU tier still serves
        assert llm.engine.kv_offload_stats()["hit_tokens_cpu"] > 0
    finally:
        llm.shutdown()


def test_disk_budget_keeps_the_folder_small(default_model_dir, prompts, reference, tmp_path):
    folder = tmp_path / "kv"
    chunk_bytes = 2 * 30 * CHUNK * 3 * 64 * 4  # float32
    budget_gb = 4.5 * chunk_bytes / 1024**3
    llm = make_llm(default_model_dir, folder, disk_size_gb=budget_gb)
    try:
        for name in ("p", "q", "r"):
            assert greedy(llm, prompts[name]) == reference[name]
            evict_pool(llm)  # fillers add 9 chunks each
        assert llm.engine.kv_offload.flush()
        files = list(folder.glob("*.data"))
        assert sum(f.stat().st_size for f in files) <= budget_gb * 1024**3 + chunk_bytes
        stats = llm.engine.kv_offload_stats()
        assert stats["disk_pruned_files"] > 0 and stats["faults"] == 0
    finally:
        llm.shutdown()


@pytest.fixture
def disk_with_p(default_model_dir, prompts, tmp_path):
    """A disk folder holding the chunks of prompt p (written by an engine that has shut down)."""
    folder = tmp_path / "kv"
    llm = make_llm(default_model_dir, folder)
    greedy(llm, prompts["p"])
    llm.shutdown()
    return folder


def test_deleted_chunk_file_is_a_miss(default_model_dir, prompts, reference, disk_with_p):
    llm = make_llm(default_model_dir, disk_with_p)
    try:
        files = chunk_files(llm, prompts["p"], disk_with_p)
        assert all(f.exists() for f in files) and len(files) >= 3
        files[1].unlink()
        assert greedy(llm, prompts["p"]) == reference["p"]
        stats = llm.engine.kv_offload_stats()
        assert stats["hit_tokens_disk"] == CHUNK and stats["faults"] == 0  # chunk 0 only
    finally:
        llm.shutdown()


def test_chunk_file_deleted_between_lookup_and_load(default_model_dir, prompts, reference, disk_with_p):
    llm = make_llm(default_model_dir, disk_with_p)
    try:
        files = chunk_files(llm, prompts["p"], disk_with_p)
        offload = llm.engine.kv_offload
        lookup = offload.lookup

        def lookup_then_lose_a_file(request, num_computed):
            found = lookup(request, num_computed)
            if files[1].exists():
                files[1].unlink()  # gone after the lookup saw it: the load must fall short
            return found

        offload.lookup = lookup_then_lose_a_file
        assert greedy(llm, prompts["p"]) == reference["p"]
        stats = llm.engine.kv_offload_stats()
        assert stats["fault_kinds"] == {"load_short": 1} and stats["hit_tokens_disk"] == CHUNK
    finally:
        llm.shutdown()


def test_truncated_chunk_file(default_model_dir, prompts, reference, disk_with_p):
    llm = make_llm(default_model_dir, disk_with_p)
    try:
        files = chunk_files(llm, prompts["p"], disk_with_p)
        with open(files[2], "r+b") as f:
            f.truncate(files[2].stat().st_size // 2)
        assert greedy(llm, prompts["p"]) == reference["p"]
        stats = llm.engine.kv_offload_stats()
        assert stats["fault_kinds"] == {"load_short": 1} and stats["hit_tokens_disk"] == 2 * CHUNK
        evict_pool(llm)
        assert greedy(llm, prompts["p"]) == reference["p"]  # the recomputed chunk was stored again
    finally:
        llm.shutdown()


@pytest.mark.parametrize("method", ["lookup", "retrieve", "store"])
def test_lmcache_raising(default_model_dir, prompts, reference, tmp_path, method):
    llm = make_llm(default_model_dir, tmp_path / "kv")
    try:
        p = prompts["p"]
        assert greedy(llm, p) == reference["p"]
        evict_pool(llm)

        def broken(*args, **kwargs):
            raise RuntimeError(f"LMCache {method} exploded")

        setattr(llm.engine.kv_offload.engine, method, broken)  # this instance only
        for name in ("p", "q"):
            assert greedy(llm, prompts[name]) == reference[name]
        stats = llm.engine.kv_offload_stats()
        kind = {"retrieve": "load"}.get(method, method)
        assert stats["faults"] >= 1 and set(stats["fault_kinds"]) == {kind}
        assert not llm.engine.has_unfinished_requests()
    finally:
        llm.shutdown()
