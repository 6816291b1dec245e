"""The greedy parity tests' prompts and transformers' outputs for them (tests/engine/test_parity.py,
tests/engine/test_parity_preemption.py; two files so that parallel workers share the work)."""

from __future__ import annotations

import pytest
import torch

from pagedserve.engine import LLM, SamplingParams
from tests.reference_cache import cached_reference

MAX_NEW = 12


def _long_text(n_items: int) -> str:
    fruits = ["apple", "banana", "cherry", "grape", "lemon", "mango", "orange", "peach", "pear", "plum"]
    lines = [f"Item {i}: a basket holds {i % 7 + 2} {fruits[i % len(fruits)]}s." for i in range(n_items)]
    return "Inventory list.\n" + "\n".join(lines) + "\nSummary: the basket with the most fruit is"


@pytest.fixture(scope="module")
def tokenizer(default_model_dir):
    from pagedserve.engine.model.tokenizer import load_tokenizer

    return load_tokenizer(default_model_dir)


@pytest.fixture(scope="module")
def prompts(tokenizer) -> list[list[int]]:
    def chat(text: str) -> list[int]:
        rendered = tokenizer.apply_chat_template(
            [{"role": "user", "content": text}], tokenize=False, add_generation_prompt=True
        )
        return tokenizer.encode(rendered, add_special_tokens=False)

    def plain(text: str) -> list[int]:
        return tokenizer.encode(text, add_special_tokens=False)

    items = [
        plain("The")[:1],  # a single token
        plain("1, 2, 3, 4,"),
        chat("What is 2 plus 2?"),
        chat("Write a haiku about the sea."),
        plain("def fibonacci(n):\n    \"\"\"Return the n-th Fibonacci number.\"\"\"\n"),
        chat("Name three primary colors and explain why they are called primary."),
        plain(_long_text(30)),  # a few hundred tokens
        plain(_long_text(110)),  # about 1,500 tokens
    ]
    lengths = [len(p) for p in items]
    assert lengths[0] == 1 and 1300 <= lengths[-1] <= 1600, lengths
    return items


@pytest.fixture(scope="module")
def hf_outputs(default_model_dir, prompts) -> list[list[int]]:
    """transformers' greedy tokens for each prompt alone (kept in the user cache per machine,
    keyed by the model's files, the prompts and the library versions: tests/reference_cache.py)."""

    def compute() -> list[list[int]]:
        from transformers import AutoModelForCausalLM

        model = AutoModelForCausalLM.from_pretrained(str(default_model_dir), dtype=torch.float32)
        model.eval()
        outs = []
        with torch.inference_mode():
            for p in prompts:
                ids = torch.tensor([p])
                gen = model.generate(
                    ids, attention_mask=torch.ones_like(ids), max_new_tokens=MAX_NEW, do_sample=False, pad_token_id=2
                )
                outs.append(gen[0, len(p) :].tolist())
        return outs

    return cached_reference("parity-greedy", [default_model_dir], {"prompts": prompts, "max_new": MAX_NEW}, compute)


def engine_outputs(llm: LLM, prompts) -> list[list[int]]:
    params = SamplingParams(max_tokens=MAX_NEW, temperature=0)
    return [o.outputs[0].token_ids for o in llm.generate(prompts, params)]
