"""KV offload faults on the real default model: each fault (unusable or full disk folder, deleted or
truncated chunk file, LMCache raising) costs a recompute and a counted warning, never a wrong
token (the prompts and the offload-off reference: offload_helpers.py).
"""

from __future__ import annotations

import shutil

import pytest

from tests.engine.kv_offload.offload_helpers import (  # noqa: F401 -- prompts, reference, tokenizer: fixtures
    CHUNK,
    chunk_files,
    evict_pool,
    greedy,
    make_llm,
    prompts,
    reference,
    run_filler,
    tokenizer,
)

pytestmark = pytest.mark.slow


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
            run_filler(llm)  # fillers add 9 chunks each
        assert llm.engine.kv_offload.flush()
        files = list(folder.glob("*.data"))
        assert sum(f.stat().st_size for f in files) <= budget_gb * 1024**3 + chunk_bytes
        stats = llm.engine.kv_offload_stats()
        assert stats["disk_pruned_files"] > 0 and stats["faults"] == 0
    finally:
        llm.shutdown()


@pytest.fixture(scope="module")
def written_by_p(default_model_dir, prompts, tmp_path_factory):
    """A disk folder holding the chunks of prompt p, written by an engine that has shut down."""
    folder = tmp_path_factory.mktemp("kv-p") / "kv"
    llm = make_llm(default_model_dir, folder)
    greedy(llm, prompts["p"])
    llm.shutdown()
    return folder


@pytest.fixture
def disk_with_p(written_by_p, tmp_path):
    """A copy of `written_by_p` of the test's own, to damage as it likes."""
    return shutil.copytree(written_by_p, tmp_path / "kv")


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
