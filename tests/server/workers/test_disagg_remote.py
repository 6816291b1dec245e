"""Disaggregated prefill across two server processes that share a Redis-protocol tier (a real
valkey-server on loopback, tests/engine/redis_server.py), as vLLM's disaggregation proxy drives
two instances: the prefill server gets the request with `max_tokens: 1` and
`kv_transfer_params: {"do_remote_decode": true}` and answers once the prompt's KV is in Redis;
the decode server gets the request itself and restores the prompt from Redis instead of
computing it, with the same greedy tokens as a server that computed everything (float32, the
tiny random-weight model)."""

from __future__ import annotations

import pytest

from tests.engine.redis_server import RedisServer
from tests.server.conftest import TINY, TINY_ARCHIVE
from tests.server.server_process import ServerProcess

MAX_TOKENS = 12


@pytest.fixture(scope="module")
def servers(tmp_path_factory, tiny_store, archive_cache):
    redis = RedisServer(tmp_path_factory.mktemp("valkey")).start()
    started: list[ServerProcess] = []
    try:
        for name in ("prefill", "decode"):
            server = ServerProcess(
                workdir=tmp_path_factory.mktemp(f"server-{name}"),
                model_store=tiny_store,
                models=[f"{TINY}={TINY_ARCHIVE}"],
                env={"PAGEDSERVE_ARCHIVE_DIR": str(archive_cache), "PAGEDSERVE_DISABLE_CPU_KERNELS": "1"},
                config={
                    "worker_threads": 1,
                    "kv_offload": {"remote_url": redis.url, "cpu_size_gb": 0.05, "chunk_size": 32},
                },
            )
            started.append(server)
        for server in started:
            server.start()
        yield started[0], started[1], redis
    finally:
        for server in started:
            server.stop()
        redis.kill()


def _prompt(i: int) -> list[int]:
    return [2000 + (i * 97 + k * 29) % 20000 for k in range(150)]


def _generate(server: ServerProcess, prompt: list[int], **extra) -> dict:
    body = {"model": TINY, "prompt": prompt, "max_tokens": MAX_TOKENS, "temperature": 0, "ignore_eos": True, **extra}
    r = server.post("inference", "/v1/completions", json=body)
    assert r.status == 200, r.text
    return r.json()


def test_prefill_on_one_server_decode_on_the_other(servers):
    prefill, decode, redis = servers
    for i in range(2):
        prompt = _prompt(i)
        # The reference: the prefill server computes it all, under a salt no one else uses.
        want = _generate(prefill, prompt, cache_salt=f"reference-{i}")["choices"][0]["text"]
        keys_before = redis.num_keys()
        r = prefill.post(
            "inference",
            "/v1/completions",
            json={
                "model": TINY,
                "prompt": prompt,
                "max_tokens": 1,
                "temperature": 0,
                "kv_transfer_params": {"do_remote_decode": True, "remote_engine_id": None},
            },
        )
        assert r.status == 200, r.text
        # Answered only once the chunks are in Redis (no waiting here).
        assert redis.num_keys() > keys_before
        body = _generate(decode, prompt)
        assert body["choices"][0]["text"] == want
        assert body["timings"]["offloaded_prompt_tokens"] == (len(prompt) - 1) // 16 * 16


def test_a_bad_kv_transfer_params_is_refused_naming_the_field(servers):
    prefill, _, _ = servers
    r = prefill.post(
        "inference",
        "/v1/completions",
        json={"model": TINY, "prompt": "hi", "kv_transfer_params": {"do_remote_decode": "yes"}},
    )
    assert r.status == 400, r.text
    assert "kv_transfer_params.do_remote_decode" in r.text
