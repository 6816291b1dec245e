"""The prepare step every request path shares (pagedserve.engine.request.inputs): rendering with the real
tokenizer's chat template, and the length / vocabulary rules as a function of (token ids,
params, limits), each refusal an InvalidInput naming the field."""

from __future__ import annotations

import pytest

from pagedserve.engine.model.tokenizer import load_tokenizer
from pagedserve.engine.request.inputs import (
    EngineInput,
    InputLimits,
    InvalidInput,
    PromptSpec,
    prepare_input,
    render_prompt,
    validate_input,
)
from pagedserve.engine.sampling.params import SamplingParams

SERVER = InputLimits(max_model_len=100, vocab_size=50)
OFFLINE = InputLimits(max_model_len=100, vocab_size=50, max_tokens_must_fit=False)


@pytest.fixture(scope="module")
def tokenizer(default_model_dir):
    return load_tokenizer(default_model_dir)


def refusal(token_ids, params, limits) -> InvalidInput:
    with pytest.raises(InvalidInput) as info:
        validate_input(token_ids, params, limits)
    return info.value


def test_length_rules_name_the_field():
    params = SamplingParams(max_tokens=10)
    validate_input([1] * 90, params, SERVER)
    err = refusal([1] * 91, params, SERVER)
    assert err.field == "max_tokens" and "max_tokens=10 is too large" in str(err) and "at most 9" in str(err)
    validate_input([1] * 91, params, OFFLINE)  # offline: runs, and ends with "length" at 100
    for limits in (SERVER, OFFLINE):
        err = refusal([1] * 100, params, limits)
        assert err.field == "prompt" and "at most 99 prompt tokens fit" in str(err)
        assert refusal([], params, limits).field == "prompt"
    validate_input([1] * 99, SamplingParams(max_tokens=None), SERVER)  # None: up to max_model_len


@pytest.mark.parametrize("bad", [[5, 50], [-1], [True], [1.0]])
def test_token_ids_must_be_ints_inside_the_vocabulary(bad):
    err = refusal(bad, SamplingParams(), SERVER)
    assert err.field == "prompt" and "out of range [0, 50)" in str(err)


def test_params_must_be_sampling_params():
    with pytest.raises(TypeError, match="SamplingParams"):
        validate_input([1], {"max_tokens": 3}, SERVER)


def test_render_text_token_ids_and_chat(tokenizer):
    text, ids = render_prompt(tokenizer, PromptSpec(text="1, 2, 3,"))
    assert text == "1, 2, 3," and ids == tokenizer.encode(text, add_special_tokens=False)
    assert render_prompt(tokenizer, PromptSpec(token_ids=[1, 2, 3])) == (None, [1, 2, 3])
    chat = [{"role": "user", "content": "2+2?"}]
    text, ids = render_prompt(tokenizer, PromptSpec(messages=chat))
    assert text.endswith("<|im_start|>assistant\n") and "2+2?" in text
    text, _ = render_prompt(tokenizer, PromptSpec(messages=chat, add_generation_prompt=False))
    assert not text.endswith("<|im_start|>assistant\n")


def test_a_chat_template_error_names_messages(tokenizer):
    with pytest.raises(InvalidInput) as info:  # SmolLM2's template indexes message['role']
        render_prompt(tokenizer, PromptSpec(messages=[{"content": "no role"}]))
    assert info.value.field == "messages" and "chat template" in str(info.value)


def test_prepare_checks_the_constraint_then_renders_and_validates(tokenizer):
    params = SamplingParams(max_tokens=4)
    limits = InputLimits(max_model_len=64, vocab_size=tokenizer.vocab_size)
    prepared = prepare_input(tokenizer, PromptSpec(text="Hello"), params, limits)
    assert prepared == EngineInput("Hello", tokenizer.encode("Hello", add_special_tokens=False), params)
    with pytest.raises(InvalidInput) as info:
        prepare_input(tokenizer, PromptSpec(text="x " * 100), params, limits)
    assert info.value.field == "prompt"
    bad_regex = SamplingParams(max_tokens=4, structured_outputs={"regex": "(unclosed"})
    with pytest.raises(InvalidInput) as info:
        prepare_input(tokenizer, PromptSpec(text="Hello"), bad_regex, limits)
    assert info.value.field == "structured_outputs" and "regex" in str(info.value)


def test_a_prompt_spec_holds_exactly_one_prompt():
    with pytest.raises(ValueError, match="exactly one"):
        PromptSpec(text="a", token_ids=[1])
    with pytest.raises(ValueError, match="exactly one"):
        PromptSpec()
