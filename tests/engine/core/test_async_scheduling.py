"""Async scheduling (EngineConfig.async_scheduling) gives the same output as synchronous
scheduling: greedy and seeded sampling, requests ending on EOS, a stop token, a stop string and
max_tokens, under preemption and aborts; every block is free at the end. Tiny random-weight
models (the real model's greedy parity with async scheduling is in test_parity.py)."""

from __future__ import annotations

import json
import random
import shutil

import pytest
import torch
import transformers

from pagedserve.engine import LLM, SamplingParams
from pagedserve.engine.config.engine import EngineConfig
from pagedserve.engine.core.engine_core import EngineCore
from pagedserve.engine.request.outputs import FinishReason
from pagedserve.engine.request.request import Request
from tests.engine.core.test_engine_invariants import check_pool_consistency

BLOCK_SIZE = 4


def make_engine(model_dir, async_scheduling: bool, num_blocks: int = 64, **options) -> EngineCore:
    return EngineCore(
        EngineConfig(
            model=str(model_dir),
            num_kv_blocks=num_blocks,
            block_size=BLOCK_SIZE,
            max_num_batched_tokens=24,
            max_num_seqs=6,
            max_model_len=48,
            async_scheduling=async_scheduling,
            **options,
        )
    )


def run_to_end(
    engine: EngineCore,
    requests: list[Request],
    abort_after: dict[str, int] | None = None,
) -> tuple[dict[str, list[int]], dict[str, FinishReason]]:
    """Drive engine.step() until every request has finished; `abort_after[id] = n` aborts a
    request once n of its tokens have come out. Checks the block pool after every step."""
    abort_after = abort_after or {}
    tokens: dict[str, list[int]] = {r.request_id: [] for r in requests}
    reasons: dict[str, FinishReason] = {}
    for r in requests:
        engine.add_request(r)
    while engine.has_unfinished_requests():
        for out in engine.step():
            assert out.request_id not in reasons, f"{out.request_id} got output after it finished"
            tokens[out.request_id].extend(out.new_token_ids)
            if out.finished:
                reasons[out.request_id] = out.finish_reason
            elif len(tokens[out.request_id]) >= abort_after.get(out.request_id, 1 << 30):
                engine.abort_requests([out.request_id])
                reasons[out.request_id] = FinishReason.ABORT
        check_pool_consistency(engine)
    assert engine.kv_manager.pool.get_num_free_blocks() == engine.kv_manager.pool.num_blocks
    return tokens, reasons


@pytest.fixture(scope="module")
def eos_token(tiny_model_dir) -> int:
    """A token the tiny model's greedy output holds in its middle: made its EOS below."""
    engine = make_engine(tiny_model_dir, False)
    tokens, _ = run_to_end(
        engine,
        [
            Request(f"p{i}", [i, i + 1, i + 2], SamplingParams(max_tokens=12, temperature=0, ignore_eos=True))
            for i in range(4)
        ],
    )
    middle = [t for seq in tokens.values() for t in seq[3:9]]
    return max(set(middle), key=middle.count)


@pytest.fixture(scope="module")
def eos_model_dir(tiny_model_dir, eos_token, tmp_path_factory):
    path = tmp_path_factory.mktemp("tiny-eos") / "model"
    shutil.copytree(tiny_model_dir, path)
    config = json.loads((path / "config.json").read_text())
    config["eos_token_id"] = eos_token
    (path / "config.json").write_text(json.dumps(config))
    return path


def mixed_requests(eos_token: int) -> list[Request]:
    """Greedy and seeded rows; some stop at EOS, one at a stop token, one at min_tokens' end."""
    requests = []
    for i in range(10):
        params = SamplingParams(
            max_tokens=4 + 3 * i,
            temperature=0.0 if i % 2 else 0.9,
            seed=None if i % 2 else 100 + i,
            top_k=0 if i % 4 else 20,
            ignore_eos=i % 3 == 0,
            logprobs=2 if i == 5 else None,
            stop_token_ids=[eos_token + 1] if i == 4 else [],
            min_tokens=3 if i == 7 else 0,
            repetition_penalty=1.3 if i == 8 else 1.0,
        )
        requests.append(Request(f"r{i}", [(5 * i + j) % 64 for j in range(2 + 3 * i)], params))
    return requests


def test_same_tokens_and_finish_reasons_as_synchronous(eos_model_dir, eos_token):
    sync_tokens, sync_reasons = run_to_end(make_engine(eos_model_dir, False), mixed_requests(eos_token))
    engine = make_engine(eos_model_dir, True)
    assert engine.async_scheduling
    async_tokens, async_reasons = run_to_end(engine, mixed_requests(eos_token))
    assert async_tokens == sync_tokens
    assert async_reasons == sync_reasons
    # The workload ends requests every way there is: EOS (discovered a step late, its extra
    # token dropped), max_tokens, and stop tokens.
    assert FinishReason.LENGTH in sync_reasons.values()
    assert sum(r is FinishReason.STOP for r in sync_reasons.values()) >= 2
    assert any(seq and seq[-1] == eos_token for seq in sync_tokens.values())


def test_same_output_under_preemption(eos_model_dir, eos_token):
    expected = run_to_end(make_engine(eos_model_dir, False), mixed_requests(eos_token))
    crowded = make_engine(eos_model_dir, True, num_blocks=13)
    assert run_to_end(crowded, mixed_requests(eos_token)) == expected
    assert crowded.scheduler.num_preemptions > 0


def test_aborted_requests_get_a_prefix_of_their_output_and_free_everything(eos_model_dir, eos_token):
    full, _ = run_to_end(make_engine(eos_model_dir, False), mixed_requests(eos_token))
    engine = make_engine(eos_model_dir, True)
    abort_after = {"r2": 1, "r6": 4, "r9": 2}
    tokens, reasons = run_to_end(engine, mixed_requests(eos_token), abort_after)
    for req_id, n in abort_after.items():
        assert reasons[req_id] is FinishReason.ABORT
        assert tokens[req_id] == full[req_id][:n]  # nothing after the abort
    assert {r: t for r, t in tokens.items() if r not in abort_after} == {
        r: t for r, t in full.items() if r not in abort_after
    }


def test_random_workload_with_aborts_keeps_the_pool_consistent(tiny_model_dir):
    engine = make_engine(tiny_model_dir, True, num_blocks=20)
    rng = random.Random(7)
    live: list[str] = []
    for step in range(150):
        if step < 100 and rng.random() < 0.5:
            req_id = f"w{step}"
            prompt = [rng.randrange(64) for _ in range(rng.randrange(1, 30))]
            params = SamplingParams(
                max_tokens=rng.randrange(1, 16), temperature=rng.choice([0.0, 1.0]), seed=step, ignore_eos=True
            )
            engine.add_request(Request(req_id, prompt, params))
            live.append(req_id)
        if live and rng.random() < 0.15:
            engine.abort_requests([live.pop(rng.randrange(len(live)))])
        for out in engine.step():
            if out.finished and out.request_id in live:
                live.remove(out.request_id)
        check_pool_consistency(engine)
    while engine.has_unfinished_requests():
        engine.step()
        check_pool_consistency(engine)
    engine.step()  # the runner forgets the last finished requests
    assert engine.scheduler.num_preemptions > 0
    assert engine.kv_manager.pool.get_num_free_blocks() == 20
    assert not engine.runner.requests and engine.runner.input_batch.num_reqs == 0


def test_speculative_decoding_turns_it_off(tiny_model_dir):
    engine = make_engine(tiny_model_dir, True, speculative={"num_speculative_tokens": 2})
    assert not engine.async_scheduling and not engine.scheduler.async_scheduling


@pytest.fixture(scope="module")
def tiny_text_model(tmp_path_factory, default_model_dir):
    """A tiny random-weight Llama with the default model's tokenizer (stop strings need text)."""
    path = tmp_path_factory.mktemp("tiny-text") / "model"
    torch.manual_seed(0)
    config = transformers.LlamaConfig(
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=2,
        num_key_value_heads=2,
        vocab_size=49152,
        max_position_embeddings=256,
    )
    transformers.LlamaForCausalLM(config).save_pretrained(path, safe_serialization=True)
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(default_model_dir / name, path / name)
    return path


def test_stop_strings_end_at_the_same_text(tiny_text_model):
    prompts = [[100 + i, 200 + i, 300 + i] for i in range(4)]
    free = SamplingParams(max_tokens=16, temperature=0, ignore_eos=True)
    sync = LLM(tiny_text_model, dtype="float32", num_threads=1, kv_cache_memory="8MiB")
    texts = [o.outputs[0].text for o in sync.generate(prompts, free)]
    stop = texts[1][len(texts[1]) // 2 :][:3]  # a piece of the second completion's middle
    assert stop.strip()
    params = SamplingParams(max_tokens=16, temperature=0, ignore_eos=True, stop=[stop])
    expected = [
        (o.outputs[0].text, o.outputs[0].token_ids, o.outputs[0].finish_reason) for o in sync.generate(prompts, params)
    ]
    llm = LLM(tiny_text_model, dtype="float32", num_threads=1, kv_cache_memory="8MiB", async_scheduling=True)
    got = [
        (o.outputs[0].text, o.outputs[0].token_ids, o.outputs[0].finish_reason) for o in llm.generate(prompts, params)
    ]
    assert got == expected
    assert expected[1][2] is FinishReason.STOP and stop not in expected[1][0]
    # The next call starts from whatever the previous one left in flight.
    assert [o.outputs[0].text for o in llm.generate(prompts, free)] == texts
    llm.shutdown()
    sync.shutdown()
