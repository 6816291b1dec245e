"""Greedy parity with Hugging Face transformers on the real default model, float32, with a KV
pool so small that requests get preempted and recomputed (also with async scheduling): the
eight prompts of tests/engine/parity_prompts.py in one mixed batch give token-for-token the
greedy output transformers gives each alone (with prefix caching and chunked prefill:
tests/engine/test_parity.py).
"""

from __future__ import annotations

import pytest

from pagedserve.engine import LLM
from tests.engine.parity_prompts import engine_outputs, hf_outputs, prompts, tokenizer  # noqa: F401 -- fixtures

pytestmark = pytest.mark.slow


def test_greedy_parity_under_preemption(default_model_dir, prompts, hf_outputs):
    # 110 blocks of 16 tokens: the ~1,500-token prompt alone needs ~95, the batch ~140.
    llm = LLM(
        default_model_dir, dtype="float32", num_kv_blocks=110, max_num_batched_tokens=512, enable_prefix_caching=False
    )
    assert engine_outputs(llm, prompts) == hf_outputs
    assert llm.engine.scheduler.num_preemptions > 0
    assert llm.engine.kv_manager.pool.get_num_free_blocks() == 110


def test_greedy_parity_async_scheduling_under_preemption(default_model_dir, prompts, hf_outputs):
    # Async scheduling (step k+1 scheduled while step k runs) under the same preemption pressure.
    llm = LLM(
        default_model_dir,
        dtype="float32",
        num_kv_blocks=110,
        max_num_batched_tokens=512,
        enable_prefix_caching=False,
        async_scheduling=True,
    )
    assert engine_outputs(llm, prompts) == hf_outputs
    assert llm.engine.scheduler.num_preemptions > 0
    llm.shutdown()
