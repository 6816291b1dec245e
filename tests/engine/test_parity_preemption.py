"""Greedy parity with Hugging Face transformers on the real default model, float32, with a KV
pool so small that requests get preempted and recomputed (also with async scheduling): the
first seven prompts of tests/engine/parity_prompts.py (1 to ~400 tokens) in one mixed batch
give token-for-token the greedy output transformers gives each alone. The ~1,500-token prompt is
left to tests/engine/test_parity.py (prefix caching, chunked prefill): under this pressure it
was preempted and prefilled again four times, ~11 s of each test here.
"""

from __future__ import annotations

import pytest

from pagedserve.engine import LLM
from tests.engine.parity_prompts import engine_outputs, hf_outputs, prompts, tokenizer  # noqa: F401 -- fixtures

pytestmark = pytest.mark.slow


SHORT = 7  # prompts[:7]: all but the ~1,500-token one
BLOCKS = 30  # of 16 tokens: the ~400-token prompt alone needs 27, the batch ~45
BUDGET = 128  # tokens a step: prompts are prefilled in chunks, and recomputed in chunks


def test_greedy_parity_under_preemption(default_model_dir, prompts, hf_outputs):
    llm = LLM(
        default_model_dir,
        dtype="float32",
        num_kv_blocks=BLOCKS,
        max_num_batched_tokens=BUDGET,
        enable_prefix_caching=False,
    )
    assert engine_outputs(llm, prompts[:SHORT]) == hf_outputs[:SHORT]
    assert llm.engine.scheduler.num_preemptions > 0
    assert llm.engine.kv_manager.pool.get_num_free_blocks() == BLOCKS


def test_greedy_parity_async_scheduling_under_preemption(default_model_dir, prompts, hf_outputs):
    # Async scheduling (step k+1 scheduled while step k runs) under the same preemption pressure.
    llm = LLM(
        default_model_dir,
        dtype="float32",
        num_kv_blocks=BLOCKS,
        max_num_batched_tokens=BUDGET,
        enable_prefix_caching=False,
        async_scheduling=True,
    )
    assert engine_outputs(llm, prompts[:SHORT]) == hf_outputs[:SHORT]
    assert llm.engine.scheduler.num_preemptions > 0
    llm.shutdown()
