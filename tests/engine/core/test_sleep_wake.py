"""EngineCore.sleep / wake in process (the worker's side of pagedserve.server.workers.lifecycle): sleeping drops
the model and the KV pool, refuses requests, and waking gives the same greedy output; a busy
engine does not sleep."""

from __future__ import annotations

import gc
import weakref

import pytest

from pagedserve.engine.config.engine import EngineConfig
from pagedserve.engine.core.engine_core import EngineCore
from pagedserve.engine.request.request import Request
from pagedserve.engine.sampling.params import SamplingParams

PROMPT = [3, 14, 15, 9, 26, 5]


def generate(engine: EngineCore, request_id: str) -> list[int]:
    engine.add_request(Request(request_id, PROMPT, SamplingParams(max_tokens=8, temperature=0, ignore_eos=True)))
    tokens: list[int] = []
    while engine.has_unfinished_requests():
        for out in engine.step():
            tokens += out.new_token_ids
    return tokens


def test_sleep_frees_the_model_and_kv_pool_and_wake_gives_the_same_output(tiny_model_dir):
    engine = EngineCore(EngineConfig(model=str(tiny_model_dir), num_kv_blocks=16, block_size=16, max_model_len=128))
    before = generate(engine, "a")
    model, kv = weakref.ref(engine.runner.model), weakref.ref(engine.runner.kv_caches[0])
    engine.sleep()
    gc.collect()
    assert engine.sleeping and model() is None and kv() is None  # nothing holds them any more
    with pytest.raises(ValueError, match="asleep"):
        engine.add_request(Request("b", PROMPT, SamplingParams(max_tokens=2)))
    engine.make_stats()  # heartbeats go on while asleep
    engine.wake()
    assert not engine.sleeping
    assert generate(engine, "c") == before


def test_a_busy_engine_does_not_sleep(tiny_model_dir):
    engine = EngineCore(EngineConfig(model=str(tiny_model_dir), num_kv_blocks=16, block_size=16, max_model_len=128))
    engine.add_request(Request("a", PROMPT, SamplingParams(max_tokens=4)))
    with pytest.raises(RuntimeError, match="unfinished requests"):
        engine.sleep()
    assert not engine.sleeping and engine.runner is not None


@pytest.mark.skipif(not __import__("torch").cuda.is_available(), reason="needs a CUDA GPU")
def test_sleep_on_a_gpu_gives_the_device_memory_back(tiny_model_dir):
    import torch

    engine = EngineCore(
        EngineConfig(model=str(tiny_model_dir), device="cuda", num_kv_blocks=256, block_size=16, max_model_len=128)
    )
    generate(engine, "a")
    awake = torch.cuda.memory_reserved()
    engine.sleep()
    asleep = torch.cuda.memory_reserved()
    assert asleep < awake // 4, (awake, asleep)  # weights and KV pool are off the device
    engine.wake()
    assert generate(engine, "b")
