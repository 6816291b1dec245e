"""The shared Redis tier of the KV offload (`kv_offload: {remote_url: redis://...}`), on the real
default model in float32 and a real Redis-protocol server on loopback (tests/engine/redis_server.py):
a prompt prefilled by one engine is restored from Redis by another engine that never saw it,
bit-exact (identical greedy output); a Redis that is down or not answering costs a recompute,
a warning and a counted fault, never a wrong token or a stall.
"""

from __future__ import annotations

import logging
import signal

import pytest

from pagedserve.engine import LLM, SamplingParams
from pagedserve.engine.config.kv_offload import KVOffloadConfig
from tests.engine.redis_server import RedisServer

pytestmark = pytest.mark.slow

CHUNK = 64
BLOCK = 16
NUM_BLOCKS = 40
GREEDY = SamplingParams(temperature=0, max_tokens=6)


def _text(n_items: int, start: int = 0, title: str = "Inventory list") -> str:
    fruits = ["apple", "banana", "cherry", "grape", "lemon", "mango", "orange", "peach", "pear", "plum"]
    lines = [f"Item {i}: a basket holds {i % 7 + 2} {fruits[i % len(fruits)]}s." for i in range(start, start + n_items)]
    return f"{title}.\n" + "\n".join(lines) + "\nSummary: the basket with the most fruit is"


@pytest.fixture(scope="module")
def prompts(default_model_dir) -> dict[str, list[int]]:
    from pagedserve.engine.model.tokenizer import load_tokenizer

    tokenizer = load_tokenizer(default_model_dir)
    enc = lambda t: tokenizer.encode(t, add_special_tokens=False)
    items = {
        "p": enc(_text(16)),
        "q": enc(_text(15, 50, "Stock report of the north shop")),
        "r": enc(_text(15, 90, "Notes from the market on Sunday")),
    }
    assert all(len(ids) > 3 * CHUNK for ids in items.values()), {k: len(v) for k, v in items.items()}
    return items


def make_llm(model_dir, remote_url: str | None) -> LLM:
    options = {"cpu_size_gb": 0.2, "chunk_size": CHUNK}
    if remote_url is not None:
        options["remote_url"] = remote_url
    return LLM(
        model_dir,
        dtype="float32",
        num_threads=1,
        num_kv_blocks=NUM_BLOCKS,
        max_model_len=NUM_BLOCKS * BLOCK,
        max_num_batched_tokens=NUM_BLOCKS * BLOCK,
        kv_offload=options,
    )


def greedy(llm: LLM, ids: list[int]) -> list[int]:
    return llm.generate([ids], GREEDY)[0].outputs[0].token_ids


def offload_stats(llm: LLM) -> dict:
    return llm.engine.kv_offload.get_stats()


@pytest.fixture(scope="module")
def redis(tmp_path_factory):
    with RedisServer(tmp_path_factory.mktemp("redis")) as server:
        yield server


@pytest.fixture(scope="module")
def reference(default_model_dir, prompts) -> dict[str, list[int]]:
    """Greedy outputs with the CPU tier only (no Redis)."""
    llm = make_llm(default_model_dir, None)
    out = {name: greedy(llm, ids) for name, ids in prompts.items()}
    llm.shutdown()
    return out


def test_a_prompt_prefilled_by_one_engine_is_restored_by_another(default_model_dir, redis, prompts, reference):
    first, second = make_llm(default_model_dir, redis.url), make_llm(default_model_dir, redis.url)
    try:
        # The prompt and one token, as a disaggregated prefill runs it: the chunks are stored in
        # the step that finishes the request.
        out = first.generate([prompts["p"]], SamplingParams(temperature=0, max_tokens=1))
        assert out[0].outputs[0].token_ids == reference["p"][:1]
        # What that prefill waits on before it answers: once it returns, every chunk is in Redis
        # (LMCache writes two keys a chunk: its bytes and its metadata), with no polling.
        assert first.engine.kv_offload.wait_for_writes()
        stored = offload_stats(first)["stored_chunks"]
        assert offload_stats(first)["hit_tokens"] == 0 and stored >= 3
        assert redis.num_keys() == 2 * stored
        # The second engine never saw the prompt: its pool and CPU tier are empty.
        assert greedy(second, prompts["p"]) == reference["p"]
        stats = offload_stats(second)
        whole_blocks = (len(prompts["p"]) - 1) // BLOCK * BLOCK
        assert stats["hit_tokens_remote"] == whole_blocks and stats["hit_tokens_cpu"] == 0
        assert stats["faults"] == 0
    finally:
        first.shutdown()
        second.shutdown()


def test_redis_down_or_not_answering_costs_a_recompute_a_warning_and_a_count(
    default_model_dir, prompts, reference, tmp_path, caplog
):
    caplog.set_level(logging.WARNING, logger="pagedserve.engine.kv_offload.manager")
    server = RedisServer(tmp_path / "redis").start()
    llm = make_llm(default_model_dir, server.url)
    try:
        assert greedy(llm, prompts["p"]) == reference["p"]
        server.proc.send_signal(signal.SIGSTOP)  # accepts connections, answers nothing
        try:
            assert greedy(llm, prompts["q"]) == reference["q"]
        finally:
            server.proc.send_signal(signal.SIGCONT)
        assert offload_stats(llm)["fault_kinds"].get("remote_slow", 0) >= 1
        server.kill()
        assert greedy(llm, prompts["r"]) == reference["r"]
        stats = offload_stats(llm)
        assert stats["fault_kinds"].get("remote_down", 0) >= 1
        assert any("Redis at" in r.getMessage() and "is down" in r.getMessage() for r in caplog.records)
        # The CPU tier still serves while Redis is down (the engine's pool was not evicted, so
        # this is its own prefix cache: the point is that nothing fails).
        assert greedy(llm, prompts["p"]) == reference["p"]
    finally:
        llm.shutdown()
        server.kill()


@pytest.mark.parametrize(
    "url, message",
    [
        ("http://127.0.0.1:6379", r"kv_offload.remote_url: must match \^rediss\?://"),
        ("redis://127.0.0.1", "needs a host and a port"),
        ("redis://:6379", "needs a host and a port"),
        ("redis://127.0.0.1:99999", "not a valid URL"),
        ("redis://127.0.0.1:6379/cache", "database number"),
        (6379, "kv_offload.remote_url: must be a string or null"),
    ],
)
def test_remote_url_is_checked(url, message):
    with pytest.raises(ValueError, match=message) as err:
        KVOffloadConfig.from_options({"remote_url": url}, block_size=BLOCK)
    assert "kv_offload.remote_url" in str(err.value)


def test_remote_url_accepted_forms():
    for url in ("redis://127.0.0.1:6379", "redis://cache.internal:6380/2", "rediss://h:6379"):
        assert KVOffloadConfig.from_options({"remote_url": url}, block_size=BLOCK).remote_url == url
