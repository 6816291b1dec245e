"""Routing among a version's workers (pagedserve.server.workers.routing): least loaded, or prefix-affine.

The policy's unit tests feed the router the two load figures it reads from a worker (requests
unfinished, KV blocks in use) through a plain record; the end-to-end tests run a real
in-process server with two engine-core workers of the tiny model and read which worker served
each request from the prefix-cache hits it reports (`timings.cached_prompt_tokens`) and from
/metrics.
"""

from __future__ import annotations

from dataclasses import dataclass

import pytest

from pagedserve.engine.model.model_config import ModelConfig, ModelConfigError
from pagedserve.server.workers.routing import Router, RoutingPolicy, prefix_hashes
from tests.server.conftest import TINY_MODEL_CONFIG

# A prompt of several full blocks (the tiny model's tokenizer: about one token per word here).
SYSTEM = " ".join(f"rule{i}" for i in range(40))


@dataclass
class Load:
    """What the router reads from a worker: its name and load (see `pagedserve.server.workers.routing.load_key`)."""

    name: str
    num_unfinished: int = 0
    stats: None = None


def test_prefix_hashes_are_chained_per_full_block():
    a = prefix_hashes(list(range(40)), block_size=16)
    b = prefix_hashes(list(range(32)) + [0] * 8, block_size=16)
    assert len(a) == 2 and a == b  # the partial third block is not hashed
    c = prefix_hashes([99] + list(range(1, 40)), block_size=16)
    assert c[0] != a[0] and c[1] != a[1]  # a change in block 0 changes every later hash
    assert prefix_hashes(list(range(4000)), 16, max_blocks=8) == prefix_hashes(list(range(128)), 16)


def test_affinity_follows_the_longest_remembered_prefix():
    w0, w1 = Load("w0"), Load("w1")
    router = Router(RoutingPolicy.PREFIX_AFFINITY, block_size=4)
    first = router.route([w0, w1], list(range(12)))
    assert first.matched_blocks == 0
    other = w1 if first.engine is w0 else w0
    # A longer prompt with the same 3 leading blocks goes to the same worker, twice in a row
    # (least-loaded alone would alternate at equal loads).
    for extra in ([50, 51, 52, 53], [50, 51, 52, 53, 60, 61, 62, 63]):
        again = router.route([w0, w1], list(range(12)) + extra)
        assert again.engine is first.engine and again.matched_blocks >= 3
    # An unrelated prompt lands on the least loaded worker; its prefix is remembered there.
    other.num_unfinished, first.engine.num_unfinished = 0, 1
    fresh = router.route([w0, w1], [7] * 8)
    assert fresh.engine is other and fresh.matched_blocks == 0
    assert router.route([w0, w1], [7] * 9).engine is other
    assert router.prefix_hits[first.engine.name] == 2 and router.prefix_hits[other.name] == 1


def test_affinity_yields_to_load_beyond_the_imbalance():
    w0, w1 = Load("w0"), Load("w1")
    router = Router(RoutingPolicy.PREFIX_AFFINITY, block_size=4, max_imbalance=2)
    owner = router.route([w0, w1], list(range(8))).engine
    spare = w1 if owner is w0 else w0
    owner.num_unfinished = 2  # at the bound: still affine
    assert router.route([w0, w1], list(range(8))).engine is owner
    owner.num_unfinished = 3  # beyond it: the least loaded worker takes it, and now owns it
    moved = router.route([w0, w1], list(range(8)))
    assert moved.engine is spare and moved.matched_blocks == 0
    owner.num_unfinished = 0
    assert router.route([w0, w1], list(range(8))).engine is spare


def test_affinity_ignores_workers_that_are_not_ready_and_stays_bounded():
    w0, w1 = Load("w0"), Load("w1")
    router = Router(RoutingPolicy.PREFIX_AFFINITY, block_size=4, capacity=5)
    owner = router.route([w0, w1], list(range(8))).engine
    spare = w1 if owner is w0 else w0
    assert router.route([spare], list(range(8))).engine is spare  # the owner is down
    for start in range(100, 140, 4):
        router.route([w0, w1], list(range(start, start + 8)))
    assert len(router) == 5


def test_least_loaded_takes_turns_at_equal_load():
    w0, w1 = Load("w0"), Load("w1")
    router = Router(RoutingPolicy.LEAST_LOADED, block_size=4)
    picks = [router.route([w0, w1], list(range(12))).engine.name for _ in range(4)]
    assert sorted(picks) == ["w0", "w0", "w1", "w1"] and picks[0] != picks[1]
    w0.num_unfinished = 1
    assert router.route([w0, w1], list(range(12))).engine is w1
    assert router.prefix_hits == {}


def test_routing_key_in_model_config():
    assert ModelConfig.from_dict({"routing": "prefix_affinity"}).routing == "prefix_affinity"
    assert ModelConfig.from_dict({}).routing == "least_loaded"
    with pytest.raises(ModelConfigError, match="routing"):
        ModelConfig.from_dict({"routing": "round_robin"})


# ---- end to end: two real workers ---------------------------------------------------------


def _store(tmp_path_factory, tiny_model, routing: str):
    from pagedserve.engine.model.archive import write_archive

    store = tmp_path_factory.mktemp(f"routing-{routing}")
    config = store.parent / f"{store.name}-model-config.yaml"
    config.write_text(TINY_MODEL_CONFIG.replace("minWorkers: 1", "minWorkers: 2") + f"routing: {routing}\n")
    write_archive(tiny_model, store, model_name="tiny", version="1.0", config_file=config)
    config.unlink()
    return store


@pytest.fixture(scope="module")
def affine_server(tmp_path_factory, tiny_model, inprocess_factory):
    store = _store(tmp_path_factory, tiny_model, "prefix_affinity")
    return inprocess_factory(model_store=str(store), load_models=["tiny=tiny.mar"])


def _chat(server, messages):
    r = server.post(
        "inference",
        "/v1/chat/completions",
        json={"model": "tiny", "messages": messages, "max_tokens": 4, "temperature": 0},
    )
    assert r.status == 200, r.body
    body = r.json()
    return body["choices"][0]["message"]["content"], body["usage"], body["timings"]


def test_multi_turn_chat_stays_on_the_worker_that_holds_its_prefix(affine_server):
    version = affine_server.state.registry.resolve("tiny", None)
    assert len(version.workers()) == 2
    messages = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": "hello there"}]
    reply, usage, _ = _chat(affine_server, messages)
    for turn in range(3):  # each turn's prompt extends the last one: its prefix is cached
        messages += [{"role": "assistant", "content": reply}, {"role": "user", "content": f"turn {turn}"}]
        previous = usage["prompt_tokens"]
        reply, usage, timings = _chat(affine_server, messages)
        assert timings["cached_prompt_tokens"] >= (previous // 16 - 1) * 16 > 0
    router = version.router
    assert sum(router.prefix_hits.values()) >= 3
    metrics = affine_server.get("metrics", "/metrics").text
    hit_lines = [line for line in metrics.splitlines() if line.startswith("pagedserve_route_prefix_hits_total{")]
    assert len(hit_lines) == 2 and any(not line.endswith(" 0.0") for line in hit_lines)
    assert "pagedserve_worker_prefix_cache_hit_tokens_total{" in metrics
