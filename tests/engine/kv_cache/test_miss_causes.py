"""Prefix-cache miss causes: the tracker's rules on their own, then each cause provoked on a real
engine (the tiny model) and reported on the request's output: first seen, evicted, salt differs,
LoRA differs, group not cached, and no miss when every full block is reused."""

from __future__ import annotations

import pytest
import torch
import transformers

from pagedserve.engine.config.engine import EngineConfig
from pagedserve.engine.core.engine_core import EngineCore
from pagedserve.engine.kv_cache.hashing import BlockHash
from pagedserve.engine.kv_cache.miss_causes import MissCause, MissTracker
from pagedserve.engine.lora.request import LoRARequest
from pagedserve.engine.request.request import Request
from pagedserve.engine.sampling.params import SamplingParams

BLOCK = 16
PROMPT = list(range(1, 42))  # 41 tokens: two full blocks can be reused (the last token is computed)
ONE_TOKEN = SamplingParams(max_tokens=1, temperature=0, ignore_eos=True)


def _h(i: int) -> BlockHash:
    return BlockHash(bytes([i]))


def test_tracker_tells_the_causes_apart_and_forgets_the_oldest():
    t = MissTracker(capacity=2)
    assert t.classify(_h(1), None) is MissCause.FIRST_SEEN
    t.record(_h(1), None)
    t.record(_h(1), ("adapter", None))
    t.record(_h(1), ("adapter", "tenant-a"))
    assert t.classify(_h(1), None) is MissCause.EVICTED
    assert t.classify(_h(1), ("adapter", "tenant-a")) is MissCause.EVICTED
    assert t.classify(_h(1), (None, "tenant-b")) is MissCause.SALT_DIFFERS  # the base model knows it
    assert t.classify(_h(1), ("adapter", "tenant-b")) is MissCause.SALT_DIFFERS
    assert t.classify(_h(1), ("other", None)) is MissCause.LORA_DIFFERS
    t.record(_h(2), None)
    t.record(_h(3), None)  # capacity 2: content 1, the least recently published, is forgotten
    assert t.classify(_h(1), None) is MissCause.FIRST_SEEN and t.classify(_h(2), None) is MissCause.EVICTED
    with pytest.raises(ValueError, match="capacity"):
        MissTracker(0)


@pytest.fixture(scope="module")
def adapter(tiny_model_dir, tmp_path_factory) -> LoRARequest:
    """A PEFT adapter of the tiny model (rank 2 on q/v)."""
    from peft import LoraConfig, get_peft_model

    path = tmp_path_factory.mktemp("miss-lora") / "a"
    torch.manual_seed(3)
    model = get_peft_model(
        transformers.LlamaForCausalLM.from_pretrained(tiny_model_dir),
        LoraConfig(r=2, lora_alpha=4, target_modules=["q_proj", "v_proj"], init_lora_weights=False),
    )
    model.save_pretrained(path)
    return LoRARequest("a", str(path))


_names = iter(range(10**9))


def _miss(core: EngineCore, prompt: list[int], **request) -> tuple[str, int] | None:
    """Run one request to its end; the prefix miss its output reported."""
    name = f"q{next(_names)}"
    core.add_request(Request(name, list(prompt), ONE_TOKEN, **request))
    reported = []
    while core.has_unfinished_requests():
        reported += [out.prefix_miss for out in core.step() if out.request_id == name and out.finished]
    assert len(reported) == 1
    return reported[0]


def test_each_cause_is_provoked_and_reported(tiny_model_dir, adapter):
    core = EngineCore(EngineConfig(str(tiny_model_dir), num_kv_blocks=12, block_size=BLOCK))
    assert _miss(core, PROMPT) == ("first_seen", 32)
    assert _miss(core, PROMPT) is None  # both full blocks reused
    assert _miss(core, PROMPT[:20] + [50, 51, 52, 53] + PROMPT[24:]) == ("first_seen", 16)  # second block new
    assert _miss(core, PROMPT, cache_salt="tenant-b") == ("salt_differs", 32)
    assert _miss(core, PROMPT, lora=adapter) == ("lora_differs", 32)
    # Known under this adapter (without a salt): the salt is what keeps it apart.
    assert _miss(core, PROMPT, lora=adapter, cache_salt="tenant-b") == ("salt_differs", 32)
    # A prompt of the whole pool (11 blocks free for it) takes every cached block's memory.
    assert _miss(core, [60 + i % 3 for i in range(12 * BLOCK - 4)]) == ("first_seen", 11 * BLOCK)
    assert core.kv_manager.pool.num_evictions > 0
    assert _miss(core, PROMPT) == ("evicted", 32)
    assert _miss(core, PROMPT, cache_salt="tenant-b") == ("evicted", 32)  # its own copy went too
    assert _miss(core, PROMPT[:10]) is None  # no full block to reuse: nothing missed

    uncached = EngineCore(
        EngineConfig(str(tiny_model_dir), num_kv_blocks=12, block_size=BLOCK, enable_prefix_caching=False)
    )
    assert _miss(uncached, PROMPT) == ("group_not_cached", 32)
    assert _miss(uncached, PROMPT) == ("group_not_cached", 32)
