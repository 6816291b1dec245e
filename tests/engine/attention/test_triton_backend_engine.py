"""The real model served through the Triton attention backend gives the torch backend's tokens.

Without a GPU both run on CPU and the kernel runs in Triton's interpreter (tests/conftest.py),
so the workload is small: three prompts, four tokens each, with chunked prefill (a 32-token
budget) and a prefix-cache hit, which exercise every layout the kernel sees: whole prompts,
chunks after cached context, and decodes.
"""

from __future__ import annotations

import pytest

from pagedserve.engine import LLM, SamplingParams

pytest.importorskip("triton")

PREFIX = "You are a careful assistant. Answer in one short sentence, and never add anything that was not asked for. "


def run(model_dir, backend: str) -> list:
    llm = LLM(
        model_dir,
        dtype="float32",
        kv_cache_memory="64MiB",
        max_model_len=256,
        max_num_batched_tokens=32,
        attention_backend=backend,
    )
    params = SamplingParams(max_tokens=4, temperature=0, ignore_eos=True)
    first = llm.generate([PREFIX + "What is 2 plus 2?", "1, 2, 3, 4,"], params)
    second = llm.generate([PREFIX + "Name a color."], params)  # its prefix is cached by now
    return first + second


def test_triton_backend_matches_torch_backend(default_model_dir):
    by_torch = run(default_model_dir, "torch")
    by_triton = run(default_model_dir, "triton")
    assert [o.outputs[0].token_ids for o in by_triton] == [o.outputs[0].token_ids for o in by_torch]
    assert by_torch[1].outputs[0].text.startswith(" 5,")
    assert by_torch[2].num_cached_tokens >= 16
    assert by_triton[2].num_cached_tokens == by_torch[2].num_cached_tokens
