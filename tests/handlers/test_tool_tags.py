"""Structural tags for `tool_choice: "auto"` (pagedserve.handlers.tool_tags), per tool-call
family, with the default model's tokenizer and the engine's grammar manager and bitmask: a
sampler over random logits, masked by the grammar, writes free text, then (the trigger forced
through the logits) a call that the family's parser reads and whose arguments validate against
the tool's schema, whatever the logits. The same sampler unmasked writes calls that do not."""

from __future__ import annotations

import json
from dataclasses import dataclass, field

import pytest
import torch

from pagedserve.engine.sampling.params import SamplingParams
from pagedserve.engine.structured_output.manager import GrammarState, StructuredOutputManager, apply_bitmask
from pagedserve.engine.structured_output.params import GrammarError, StructuredOutputsParams, check_grammar
from pagedserve.handlers.openai_protocol import parse_chat_request
from pagedserve.handlers.openai_tools import ToolParser, parse_output
from pagedserve.handlers.tool_tags import CALL_FORMATS, structural_tag, with_tool_constraint

jsonschema = pytest.importorskip("jsonschema")

WEATHER = {
    "type": "object",
    "properties": {
        "city": {"type": "string"},
        "unit": {"enum": ["celsius", "fahrenheit"]},
        "days": {"type": "integer"},
    },
    "required": ["city", "unit"],
    "additionalProperties": False,
}
ZONE = {
    "type": "object",
    "properties": {"zone": {"type": "string"}},
    "required": ["zone"],
    "additionalProperties": False,
}
TOOLS = [
    {"type": "function", "function": {"name": "get_weather", "parameters": WEATHER}},
    {"type": "function", "function": {"name": "get_time", "parameters": ZONE}},
]
SCHEMAS = {"get_weather": WEATHER, "get_time": ZONE}
ASK = [{"role": "user", "content": "Weather in Paris?"}]
FAMILIES = [ToolParser.HERMES, ToolParser.LLAMA3_JSON, ToolParser.MISTRAL]
MAX_STEPS = 400


def chat(**extra):
    return parse_chat_request({"model": "m", "messages": ASK, "tools": TOOLS, **extra})


@dataclass
class _Req:
    request_id: str
    sampling_params: SamplingParams
    grammar: GrammarState | None = None
    tokens: list[int] = field(default_factory=list)


@pytest.fixture(scope="module")
def tokenizer_and_manager():
    from transformers import AutoTokenizer

    from pagedserve.engine.model.default_model import default_model_dir

    try:
        model_dir = default_model_dir()
    except FileNotFoundError as exc:
        pytest.skip(str(exc))
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    manager = StructuredOutputManager(str(model_dir), len(tokenizer), frozenset({tokenizer.eos_token_id}))
    yield tokenizer, manager
    manager.shutdown()


def _closers(tokenizer) -> torch.Tensor:
    """Token ids whose text holds a JSON closer: a bias on them keeps random JSON short."""
    vocab = tokenizer.convert_ids_to_tokens(list(range(len(tokenizer))))
    return torch.tensor([i for i, t in enumerate(vocab) if any(c in t for c in '"}],')])


def _sample(tokenizer, manager, parser, *, seed, masked=True, parallel=False, text_tokens=4):
    """Text, the trigger (forced through the logits), then whatever the random logits pick,
    masked by the grammar (every token checked: the matcher accepts it) until the grammar
    ends or MAX_STEPS. -> (generated text, whether the grammar ended)."""
    body = chat(parallel_tool_calls=parallel)
    params = with_tool_constraint(body.params, body.tools, parser)
    request = _Req(f"r{seed}", params)
    manager.add_request(request)
    request.grammar.future.result(timeout=60)
    assert request.grammar.poll(0.0)
    eos = tokenizer.eos_token_id
    trigger = tokenizer.encode(CALL_FORMATS[parser].triggers[0])
    closers = _closers(tokenizer)
    gen = torch.Generator().manual_seed(seed)
    forced: list[int] = []
    for step in range(MAX_STEPS):
        logits = torch.randn(1, len(tokenizer), generator=gen) * 4
        if step < text_tokens:
            logits[0, eos] = -1e9  # some text first
        elif step == text_tokens:
            forced = list(trigger)
        if forced:
            logits[0, forced.pop(0)] += 1e4  # the trigger, through the logits
        else:
            logits[0, closers] += 2 + step / 20
            logits[0, eos] += step / 10 if step > text_tokens + len(trigger) else -1e9
        if masked:
            bitmask, rows = manager.bitmask([(request, [])])
            apply_bitmask(logits, bitmask, [rows[request.request_id]])
        token = int(torch.multinomial(torch.softmax(logits[0], -1), 1, generator=gen))
        if masked:
            assert request.grammar.accept(token), f"the grammar refused sampled token {token} at step {step}"
        if token == eos:
            break
        request.tokens.append(token)
        if masked and request.grammar.is_terminated:
            break
    return tokenizer.decode(request.tokens), token == eos or request.grammar.is_terminated


def _check_calls(text, parser, tools):
    parsed = parse_output(text, tools, parser)
    assert parsed.calls, f"no call read from {text!r}"
    for call in parsed.calls:
        jsonschema.validate(json.loads(call.arguments), SCHEMAS[call.name])
    return parsed


@pytest.mark.parametrize("parser", FAMILIES, ids=lambda p: p.value)
@pytest.mark.parametrize("seed", range(4))
def test_random_logits_masked_by_the_tag_write_text_then_a_valid_call(tokenizer_and_manager, parser, seed):
    tokenizer, manager = tokenizer_and_manager
    text, ended = _sample(tokenizer, manager, parser, seed=seed)
    assert ended, f"the grammar did not end in {MAX_STEPS} steps: {text!r}"
    parsed = _check_calls(text, parser, chat().tools)
    assert len(parsed.calls) == 1  # parallel_tool_calls false: the grammar ends after the first call
    trigger = CALL_FORMATS[parser].triggers[0]
    assert parsed.content and parsed.content.strip() == text[: text.index(trigger)].strip()


@pytest.mark.parametrize("parser", FAMILIES, ids=lambda p: p.value)
def test_without_the_mask_the_same_sampler_writes_no_valid_call(tokenizer_and_manager, parser):
    tokenizer, manager = tokenizer_and_manager
    for seed in range(2):
        text, _ = _sample(tokenizer, manager, parser, seed=seed, masked=False)
        with pytest.raises((AssertionError, jsonschema.ValidationError, ValueError, KeyError)):
            _check_calls(text, parser, chat().tools)


def test_parallel_calls_leave_free_text_between_calls(tokenizer_and_manager):
    """With parallel calls the text after a call is free again: the grammar allows the stop
    token there and a second trigger opens a second bound call."""
    tokenizer, manager = tokenizer_and_manager
    request = _Req("p", with_tool_constraint(chat().params, chat().tools, ToolParser.HERMES))
    manager.add_request(request)
    request.grammar.future.result(timeout=60)
    request.grammar.poll(0.0)
    call = '<tool_call>\n{"name": "get_time", "arguments": {"zone": "CET"}}\n</tool_call>'
    for token in tokenizer.encode("Sure. " + call + " and " + call):
        assert request.grammar.accept(token)
    assert request.grammar.accept(tokenizer.eos_token_id)
    # A call whose arguments break the schema is refused at the first bad token.
    bad = _Req("b", request.sampling_params)
    manager.add_request(bad)
    bad.grammar.future.result(timeout=60)
    bad.grammar.poll(0.0)
    tokens = tokenizer.encode('<tool_call>\n{"name": "get_time", "arguments": {"zone": 3}}')
    assert not all(bad.grammar.accept(t) for t in tokens)


def test_which_requests_get_a_tag():
    params = chat().params
    assert params.structured_outputs is None  # parsing alone: the model's parser is not known yet
    tagged = with_tool_constraint(params, chat().tools, ToolParser.HERMES).structured_outputs
    tag = json.loads(tagged.structural_tag)
    assert tag["format"]["triggers"] == ["<tool_call>"] and tag["format"]["stop_after_first"] is False
    assert [t["begin"] for t in tag["format"]["tags"]] == [
        '<tool_call>\n{"name": "get_weather", "arguments": ',
        '<tool_call>\n{"name": "get_time", "arguments": ',
    ]
    check_grammar(tagged)
    llama = structural_tag(chat().tools, ToolParser.LLAMA3_JSON)["format"]
    assert [t["begin"] for t in llama["tags"]][:2] == [
        '<|python_tag|>{"name": "get_weather", "parameters": ',
        '{"name": "get_weather", "parameters": ',
    ]
    # No tag: pythonic calls, `required` (a JSON schema already), the body's own constraint.
    assert with_tool_constraint(params, chat().tools, ToolParser.PYTHONIC) is params
    required = chat(tool_choice="required")
    assert with_tool_constraint(required.params, required.tools, ToolParser.HERMES) is required.params
    own = chat(response_format={"type": "json_object"})
    assert with_tool_constraint(own.params, own.tools, ToolParser.HERMES) is own.params


def test_structural_tag_as_a_structured_outputs_option():
    tag = structural_tag(chat().tools, ToolParser.MISTRAL)
    params = StructuredOutputsParams(structural_tag=tag)
    assert params.kind == "structural_tag" and json.loads(params.structural_tag) == tag
    check_grammar(params)
    with pytest.raises(GrammarError, match="invalid structural_tag constraint"):
        check_grammar(StructuredOutputsParams(structural_tag={"type": "structural_tag", "format": {"type": "nope"}}))
    with pytest.raises(ValueError, match="structural_tag: must be an object"):
        StructuredOutputsParams(structural_tag="[1]")
    with pytest.raises(ValueError, match="give exactly one of"):
        StructuredOutputsParams(structural_tag=tag, regex="a")
