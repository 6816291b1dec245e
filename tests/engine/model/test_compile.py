"""The compiled forward (pagedserve.engine.model.compile): bucketing, the option, and greedy parity.

Compiling is slow (a bucket of the tiny model took 40+ s cold on a busy 2-core machine, one of
the real model 1-5 minutes), so the tiny model compiles one bucket (4 tokens) into a tmp_path
cache, shared by the module, and the real-model test (one bucket) runs only when asked.
"""

from __future__ import annotations

import os

import pytest
import torch

from pagedserve.engine.config.engine import EngineConfig
from pagedserve.engine.core.engine_core import EngineCore
from pagedserve.engine.model.compile import (
    AUTO_POLICY,
    CompiledForward,
    CompileMode,
    compile_buckets,
    compiled_forward_for,
    token_buckets,
)
from pagedserve.engine.model.model_config import HANDLER_KEYS
from pagedserve.engine.request.request import Request
from pagedserve.engine.sampling.params import SamplingParams


def test_token_buckets_are_powers_of_two_up_to_the_budget():
    assert token_buckets(2048) == (1, 2, 4, 8, 16, 32, 64, 128, 256, 512, 1024, 2048)
    assert token_buckets(24) == (1, 2, 4, 8, 16, 24)
    assert token_buckets(2048, 16) == (1, 2, 4, 8, 16)
    assert token_buckets(2048, 20) == (1, 2, 4, 8, 16)
    assert token_buckets(1) == (1,)


def test_compile_option_is_checked_and_a_model_config_key():
    assert EngineConfig(model="m").compile is CompileMode.NONE
    assert EngineConfig(model="m", compile="auto").compile is CompileMode.AUTO
    with pytest.raises(ValueError, match='compile: must be one of "none", "auto", "always", got "yes"'):
        EngineConfig(model="m", compile="yes")
    with pytest.raises(ValueError, match="compile_max_tokens: must be >= 1, got 0"):
        EngineConfig(model="m", compile_max_tokens=0)
    assert {"compile", "compile_max_tokens", "compile_cache_dir"} <= set(HANDLER_KEYS)


def _greedy(engine: EngineCore, prompts: list[list[int]], max_tokens: int) -> list[list[int]]:
    params = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)
    for i, prompt in enumerate(prompts):
        engine.add_request(Request(f"r{i}", prompt, params))
    tokens: dict[str, list[int]] = {f"r{i}": [] for i in range(len(prompts))}
    while engine.has_unfinished_requests():
        for out in engine.step():
            tokens[out.request_id].extend(out.new_token_ids)
    return [tokens[f"r{i}"] for i in range(len(prompts))]


TINY = {"num_kv_blocks": 64, "block_size": 4, "max_num_batched_tokens": 4, "max_model_len": 96}


@pytest.fixture(scope="module")
def compiled_engine(tiny_model_dir, tmp_path_factory):
    """The tiny model in float32 with one compiled bucket of 4 tokens (one cold compile: over a
    minute on a busy 2-core machine, 16 s on a quieter one), so every step of this budget runs compiled."""
    cache = tmp_path_factory.mktemp("inductor")
    config = EngineConfig(model=str(tiny_model_dir), **TINY, compile_cache_dir=str(cache))
    engine = EngineCore(config)
    runner = engine.runner
    runner.compiled = compiled_forward_for(config, runner.model, runner.backend, runner.kv_caches, (4,))
    assert any(cache.iterdir())  # inductor wrote its cache there
    return engine


def test_compile_buckets_follow_the_option():
    cpu = torch.device("cpu")
    assert compile_buckets(EngineConfig(model="m", max_num_batched_tokens=8), torch.float32, cpu) == ()
    always = EngineConfig(model="m", max_num_batched_tokens=8, compile="always")
    assert compile_buckets(always, torch.float32, cpu) == (1, 2, 4, 8)
    capped = EngineConfig(model="m", max_num_batched_tokens=8, compile="always", compile_max_tokens=2)
    assert compile_buckets(capped, torch.bfloat16, cpu) == (1, 2)
    # auto: only what AUTO_POLICY measured to gain (nothing on the measured machine).
    for dtype in (torch.float32, torch.bfloat16):
        expected = token_buckets(8, AUTO_POLICY.max_tokens[dtype]) if dtype in AUTO_POLICY.max_tokens else ()
        assert (
            compile_buckets(EngineConfig(model="m", max_num_batched_tokens=8, compile="auto"), dtype, cpu) == expected
        )
    assert compile_buckets(EngineConfig(model="m", compile="auto", quantization="int8"), torch.bfloat16, cpu) == ()
    tensor_parallel = EngineConfig(model="m", compile="always", tensor_parallel_size=2)
    assert compile_buckets(tensor_parallel, torch.float32, cpu) == ()  # a TP worker stays eager


def test_compiled_engine_matches_eager_greedy(tiny_model_dir, compiled_engine):
    """Chunked prefills of up to 4 tokens and decodes of 1-3 sequences all run compiled in the
    bucket of 4 (padded rows included), with the same greedy tokens as the eager engine (float32)."""
    compiled = compiled_engine.runner.compiled
    assert compiled.warm and compiled.buckets == (4,)
    prompts = [[1, 2, 3], list(range(5, 25)), [7] * 11]
    eager = _greedy(EngineCore(EngineConfig(model=str(tiny_model_dir), **TINY)), prompts, 12)
    calls = []  # the token count of every call into the compiled graph
    real_call = compiled._compiled
    compiled._compiled = lambda *args: calls.append(args[0].shape[0]) or real_call(*args)
    try:
        assert _greedy(compiled_engine, prompts, 12) == eager
    finally:
        compiled._compiled = real_call
    assert len(calls) > 12 and set(calls) == {4}


def test_compile_none_leaves_the_engine_eager(tiny_model_dir):
    engine = EngineCore(EngineConfig(model=str(tiny_model_dir), num_kv_blocks=16, compile="none"))
    assert engine.runner.compiled is None


def test_padded_rows_write_no_kv_and_steps_past_the_largest_bucket_are_refused(compiled_engine):
    compiled: CompiledForward = compiled_engine.runner.compiled
    kv_caches = compiled_engine.runner.kv_caches
    assert compiled.covers(1) and compiled.covers(4) and not compiled.covers(5)
    assert not compiled.covers(1, lora=object())
    before = [kv.clone() for kv in kv_caches]
    compiled.warm_up(kv_caches)  # steps of padding only (already compiled: no new compile)
    assert all(torch.equal(a, b) for a, b in zip(before, kv_caches))
    with pytest.raises(ValueError, match="5 tokens exceed the largest compiled bucket 4"):
        compiled(torch.zeros(5, dtype=torch.int64), torch.zeros(5, dtype=torch.int64), kv_caches, None)


@pytest.mark.slow
@pytest.mark.skipif(
    not os.environ.get("PAGEDSERVE_TEST_COMPILE_REAL"),
    reason="one cold compile of the real model: 1-5 minutes on 2 cores, over the suite's "
    "budget; set PAGEDSERVE_TEST_COMPILE_REAL=1 to run it",
)
def test_real_model_greedy_unchanged_with_compiled_decode(default_model_dir, tmp_path):
    """The default model in bfloat16 (plain weights that inductor freezes and packs, against
    the eager engine's packed ones), decode steps compiled (bucket 1): the same greedy tokens,
    "1, 2, 3, 4," -> " 5, 6, 7"."""
    from pagedserve.engine.model.tokenizer import load_tokenizer

    tokenizer = load_tokenizer(default_model_dir)
    prompt = tokenizer.encode("1, 2, 3, 4,", add_special_tokens=False)
    options = {"model": str(default_model_dir), "dtype": "bfloat16", "num_kv_blocks": 16, "max_model_len": 128}
    (eager,) = _greedy(EngineCore(EngineConfig(**options)), [prompt], 8)
    engine = EngineCore(
        EngineConfig(**options, compile="always", compile_max_tokens=1, compile_cache_dir=str(tmp_path))
    )
    assert engine.runner.compiled.buckets == (1,)
    (tokens,) = _greedy(engine, [prompt], 8)
    assert tokens == eager and tokenizer.decode(tokens).startswith(" 5, 6, 7")
