"""The hybrid KV cache through the real engine (scheduler, paged cache, sampler) on a tiny
random Gemma 3 (5 sliding layers with a 32-token window, 1 full layer: 6 KV cache groups of one
layer) with a 4,096-token prompt: after every step each sliding group holds exactly the blocks
its window can still see (at most ceil(32 / 16) + 1 = 3) while the full group holds them all; the
same prompt again hits the prefix cache in every group and decodes the same tokens. Also: the
same KV budget holds more such sequences at once than without the hybrid cache."""

from __future__ import annotations

import json

import pytest
import torch
import transformers

from pagedserve.engine.attention.kv_dtype import KVCacheDtype
from pagedserve.engine.config.engine import EngineConfig
from pagedserve.engine.core.engine_core import EngineCore
from pagedserve.engine.model.kv_pool_size import kv_layout, kv_pool_size
from pagedserve.engine.model.registry import parse_config
from pagedserve.engine.request.request import Request
from pagedserve.engine.sampling.params import SamplingParams

BLOCK = 16
WINDOW = 32
PROMPT = 4096
NUM_BLOCKS = 300
NEW_TOKENS = 6


def cdiv(a: int, b: int) -> int:
    return -(-a // b)


@pytest.fixture(scope="module")
def gemma3_dir(tmp_path_factory):
    torch.manual_seed(0)
    config = transformers.Gemma3TextConfig(
        vocab_size=256,
        hidden_size=32,
        intermediate_size=48,
        num_attention_heads=2,
        num_key_value_heads=1,
        head_dim=16,
        num_hidden_layers=6,
        sliding_window=WINDOW,
        max_position_embeddings=8192,
        query_pre_attn_scalar=16,
        eos_token_id=None,
        bos_token_id=None,
        pad_token_id=None,
    )
    assert config.layer_types.count("sliding_attention") == 5
    path = tmp_path_factory.mktemp("gemma3-hybrid")
    transformers.Gemma3ForCausalLM(config).save_pretrained(path)
    return path


def _engine(path, **options) -> EngineCore:
    config = dict(
        model=str(path),
        dtype="float32",
        block_size=BLOCK,
        max_num_batched_tokens=64,
        max_num_seqs=8,
        max_model_len=PROMPT + 64,
    )
    return EngineCore(EngineConfig(**{**config, **options}))


def _prompt(seed: int = 1) -> list[int]:
    return torch.randint(0, 256, (PROMPT,), generator=torch.Generator().manual_seed(seed)).tolist()


@pytest.fixture(scope="module")
def served_once(gemma3_dir):
    """One engine; the prompt served once, sampling every group's blocks after each step."""
    engine = _engine(gemma3_dir, num_kv_blocks=NUM_BLOCKS)
    params = SamplingParams(max_tokens=NEW_TOKENS, temperature=0, ignore_eos=True)
    engine.add_request(Request("first", _prompt(), params))
    samples, tokens = [], []
    while engine.has_unfinished_requests():
        tokens.extend(t for out in engine.step() for t in out.new_token_ids)
        request = engine.scheduler.requests.get("first")
        if request is not None:
            held = [group.num_held_blocks("first") for group in engine.kv_manager.groups]
            samples.append((request.num_computed_tokens, held, engine.kv_manager.pool.get_num_free_blocks()))
    return engine, samples, tokens


def test_sliding_groups_hold_only_their_window(served_once):
    engine, samples, tokens = served_once
    windows = [group.window for group in engine.kv_manager.groups]
    assert windows == [None] + [WINDOW] * 5 and engine.runner.kv_layout.num_tensors == 1
    assert len(tokens) == NEW_TOKENS
    assert len(samples) == PROMPT // 64 + NEW_TOKENS - 2  # every chunk, every decode but the last
    for computed, held, free in samples:
        # The next query (at `computed`) sees computed - 31 .. computed: the blocks of the
        # positions before it from computed - 31 on; the full group holds every block.
        first = max(0, computed - WINDOW + 1) // BLOCK
        expected = cdiv(computed, BLOCK) - first
        assert held == [cdiv(computed, BLOCK)] + [expected] * 5, computed
        assert expected <= cdiv(WINDOW, BLOCK) + 1
        assert free == NUM_BLOCKS - sum(held)
    assert samples[-1][1] == [cdiv(PROMPT + NEW_TOKENS - 1, BLOCK)] + [3] * 5
    assert engine.kv_manager.pool.get_num_free_blocks() == NUM_BLOCKS


def test_same_prompt_hits_the_prefix_cache_in_every_group(served_once):
    engine, _, first_tokens = served_once
    params = SamplingParams(max_tokens=NEW_TOKENS, temperature=0, ignore_eos=True)
    before = [group.num_hit_blocks for group in engine.kv_manager.groups]
    engine.add_request(Request("second", _prompt(), params))
    tokens = []
    while engine.has_unfinished_requests():
        tokens.extend(t for out in engine.step() for t in out.new_token_ids)
    hits = [group.num_hit_blocks - b for group, b in zip(engine.kv_manager.groups, before)]
    # 255 blocks (4,080 tokens; the last block is recomputed): all of them in the full group;
    # the window of the query at 4,080 (4,049..4,080): blocks 253 and 254 in each sliding group.
    assert hits == [255] + [2] * 5
    assert tokens == first_tokens


def test_the_same_budget_holds_more_long_sequences(gemma3_dir):
    """Sequences of 4,096 prompt tokens resident at once (whole prompt computed, decoding) in one
    KV budget, with and without the hybrid cache; 12 are offered, until the first preemption."""
    resident = {}
    for hybrid in (True, False):
        engine = _engine(
            gemma3_dir,
            kv_cache_memory=6 * 1024 * 1024,
            hybrid_kv_cache=hybrid,
            max_num_seqs=16,
            max_num_batched_tokens=512,
            max_model_len=PROMPT + 256,
        )
        params = SamplingParams(max_tokens=200, temperature=0, ignore_eos=True)
        for i in range(12):
            engine.add_request(Request(f"r{i}", _prompt(i), params))
        most = 0
        while engine.has_unfinished_requests() and engine.scheduler.num_preemptions == 0:
            engine.step()
            most = max(most, sum(r.num_computed_tokens >= PROMPT for r in engine.scheduler.running))
        resident[hybrid] = most, engine.runner.num_blocks
    print("\n4,096-token sequences resident at once in 6 MiB of KV (hybrid, without):", resident)
    # 6 MiB: 3,072 one-layer blocks (hybrid) or 512 six-layer blocks. A decoding sequence takes
    # 257+ full blocks and 5 x 3 sliding ones (hybrid): 11 fit; or 257+ six-layer blocks: 1.
    assert resident[True][1] == 6 * resident[False][1] == 3072
    assert resident[False][0] == 1 and resident[True][0] >= 10


def test_full_layers_on_triton_and_sliding_layers_on_torch(gemma3_dir):
    """The backend per attention kind: with `attention_backend: triton` (Triton's interpreter on a
    CPU) the full layer runs the Triton kernel and the sliding ones the torch path (the kernel
    has no window), with the torch backend's tokens, a prompt three windows long."""
    pytest.importorskip("triton")
    prompt = _prompt(7)[:100]
    tokens, kinds = {}, {}
    for backend in ("torch", "triton"):
        engine = _engine(gemma3_dir, num_kv_blocks=64, attention_backend=backend, max_model_len=256)
        layers = engine.runner.model.model.layers
        kinds[backend] = [(layer.self_attn.window, layer.self_attn.backend.name) for layer in layers]
        engine.add_request(Request("r", prompt, SamplingParams(max_tokens=4, temperature=0, ignore_eos=True)))
        tokens[backend] = []
        while engine.has_unfinished_requests():
            tokens[backend].extend(t for out in engine.step() for t in out.new_token_ids)
    assert kinds["triton"] == [(WINDOW, "torch")] * 5 + [(None, "triton")]
    assert kinds["torch"] == [(WINDOW, "torch")] * 5 + [(None, "torch")]
    assert tokens["triton"] == tokens["torch"] and len(tokens["torch"]) == 4


def _greedy(engine: EngineCore, prompts: list[list[int]], max_tokens: int = 8) -> list[list[int]]:
    params = SamplingParams(max_tokens=max_tokens, temperature=0, ignore_eos=True)
    ids = [f"g{i}" for i in range(len(prompts))]
    for req_id, prompt in zip(ids, prompts):
        engine.add_request(Request(req_id, prompt, params))
    tokens: dict[str, list[int]] = {req_id: [] for req_id in ids}
    while engine.has_unfinished_requests():
        for out in engine.step():
            tokens[out.request_id].extend(out.new_token_ids)
    return [tokens[req_id] for req_id in ids]


def test_preemption_and_speculative_decoding_keep_the_tokens(gemma3_dir):
    """Greedy tokens of three 200-token prompts (with repeats, for the n-gram drafter) as with a
    roomy pool: in a pool too small for all three (preemptions, recomputed in fresh blocks of
    every group), and with n-gram and draft-model speculation (drafts rolled back in sliding
    groups)."""
    prompts = [(_prompt(i)[:50] * 4) for i in range(3)]
    options = dict(max_model_len=256)
    reference = _greedy(_engine(gemma3_dir, num_kv_blocks=300, **options), prompts)
    tight = _engine(gemma3_dir, num_kv_blocks=80, **options)
    assert _greedy(tight, prompts) == reference
    assert tight.scheduler.num_preemptions > 0
    for speculative in (
        {"method": "ngram", "num_speculative_tokens": 3},
        {"method": "draft", "draft_model": str(gemma3_dir), "num_speculative_tokens": 3},
    ):
        engine = _engine(gemma3_dir, num_kv_blocks=300, speculative=speculative, **options)
        assert _greedy(engine, prompts) == reference, speculative["method"]
        assert engine.scheduler.num_accepted_tokens > 0
        assert engine.kv_manager.pool.get_num_free_blocks() == 300


def test_kv_offload_serves_a_sliding_window_model_with_one_group(gemma3_dir, tmp_path):
    """With LMCache offload on, the cache is one group of every layer (the connector copies one
    block table across all layers): a prompt restored from the CPU tier after the pool lost it
    decodes the tokens it decoded when computed."""
    pytest.importorskip("lmcache")
    engine = _engine(
        gemma3_dir,
        num_kv_blocks=40,
        max_model_len=640,
        max_num_batched_tokens=640,
        kv_offload={"cpu_size_gb": 0.05, "chunk_size": 64},
    )
    try:  # LMCache's threads end only when the engine shuts down
        assert [g.window for g in engine.kv_manager.groups] == [None] and not engine.runner.kv_layout.is_hybrid
        prompt = _prompt(3)[:300]
        first = _greedy(engine, [prompt])
        _greedy(engine, [_prompt(4)[:630]], max_tokens=1)  # needs every block: the pool forgets the prompt
        params = SamplingParams(max_tokens=8, temperature=0, ignore_eos=True)
        engine.add_request(Request("again", prompt, params))
        tokens, restored = [], 0
        while engine.has_unfinished_requests():
            for out in engine.step():
                tokens.extend(out.new_token_ids)
                restored = max(restored, out.num_external_cached_tokens)
        assert restored >= 256 and tokens == first[0]
    finally:
        engine.shutdown()


def test_kv_budget_divides_by_a_page_of_the_shared_tensors(gemma3_dir, served_once):
    """A block is one page of the layout's shared tensors: one layer here (groups of one layer),
    six layers without the hybrid cache or with tensor parallelism / KV offload (one group)."""
    spec = parse_config(json.loads((gemma3_dir / "config.json").read_text()))
    layer_page = 2 * BLOCK * 1 * 16 * 4  # keys and values, 1 KV head of 16, float32
    cases = [({}, 1), ({"hybrid_kv_cache": False}, 6), ({"kv_offload": {"cpu_size_gb": 0.05}}, 6)]
    for options, layers in cases:
        config = EngineConfig(model=str(gemma3_dir), kv_cache_memory="1MiB", **options)
        assert kv_layout(config, spec).num_tensors == layers
        assert kv_pool_size(config, spec, KVCacheDtype.AUTO) == (layers * layer_page, 2**20 // (layers * layer_page))
    engine = served_once[0]
    caches = engine.runner.kv_caches
    assert len(caches) == 6 and all(c is caches[0] for c in caches)  # every group's layer: tensor 0
    assert caches[0].numel() * caches[0].element_size() == NUM_BLOCKS * layer_page
