"""Greedy parity with Hugging Face transformers on the real default model, float32.

Eight varied prompts (plain and chat, 1 to ~1,500 tokens) run in one mixed batch through our
engine must give token-for-token the same greedy output as transformers `generate` run on each
prompt alone: with prefix caching on and with a budget that forces chunked prefill; under
preemption in tests/engine/test_parity_preemption.py (the prompts: tests/engine/parity_prompts.py).
"""

from __future__ import annotations

import pytest

from pagedserve.engine import LLM
from tests.engine.parity_prompts import engine_outputs, hf_outputs, prompts, tokenizer  # noqa: F401 -- fixtures

pytestmark = pytest.mark.slow


def test_greedy_parity_batched_with_prefix_caching(default_model_dir, prompts, hf_outputs):
    llm = LLM(default_model_dir, dtype="float32", kv_cache_memory="512MiB")
    assert engine_outputs(llm, prompts) == hf_outputs
    # Second pass: every prompt now hits the prefix cache and must not change the output.
    assert engine_outputs(llm, prompts) == hf_outputs
    assert llm.engine.kv_manager.num_hit_tokens > 0


def test_greedy_parity_chunked_prefill(default_model_dir, prompts, hf_outputs):
    llm = LLM(default_model_dir, dtype="float32", kv_cache_memory="512MiB", max_num_batched_tokens=96)
    assert engine_outputs(llm, prompts) == hf_outputs
