"""Structured output: parameter checks, grammar parsing, scheduling around compiles, and the real
model constrained to JSON schemas, JSON, regexes, choices and grammars."""

from __future__ import annotations

import concurrent.futures
import json
import re
import threading
import time

import pytest
import xgrammar as xgr

from pagedserve.engine import LLM, SamplingParams
from pagedserve.engine.structured_output.manager import GrammarState
from pagedserve.engine.structured_output.params import GrammarError, StructuredOutputsParams, check_grammar
from tests.engine.kv_helpers import make_request
from tests.engine.scheduler.test_scheduler import make_scheduler, step

PERSON = {
    "type": "object",
    "properties": {"name": {"type": "string"}, "age": {"type": "integer"}},
    "required": ["name", "age"],
}


# -- parameters ---------------------------------------------------------------------------------


def test_params_take_exactly_one_constraint():
    assert StructuredOutputsParams(json=PERSON).json == json.dumps(PERSON)  # kept as JSON text
    assert StructuredOutputsParams(json_object=True).kind == "json_object"
    with pytest.raises(ValueError, match="exactly one of .* got none"):
        StructuredOutputsParams()
    with pytest.raises(ValueError, match="got regex, choice"):
        StructuredOutputsParams(regex="a", choice=["a"])
    with pytest.raises(ValueError, match="not valid JSON"):
        StructuredOutputsParams(json="{nope")
    with pytest.raises(ValueError, match="choice: must not be empty"):
        StructuredOutputsParams(choice=[])
    with pytest.raises(ValueError, match="regex: must not be empty"):
        StructuredOutputsParams(regex="")


def test_sampling_params_take_a_mapping_and_refuse_min_tokens():
    params = SamplingParams(structured_outputs={"choice": ["yes", "no"]})
    assert params.structured_outputs == StructuredOutputsParams(choice=["yes", "no"])
    with pytest.raises(ValueError, match="unknown field"):
        SamplingParams(structured_outputs={"schema": PERSON})
    with pytest.raises(ValueError, match="min_tokens"):
        SamplingParams(min_tokens=2, structured_outputs={"json_object": True})


@pytest.mark.parametrize(
    ("params", "message"),
    [
        (StructuredOutputsParams(json={"type": "nonsense"}), 'invalid json constraint: Unsupported type "nonsense"'),
        (StructuredOutputsParams(regex="a(b"), "invalid regex constraint: Regex parsing error"),
        (StructuredOutputsParams(grammar="root ::= other"), 'invalid grammar constraint: EBNF parser error'),
    ],
)
def test_check_grammar_refuses_with_a_clean_message(params, message):
    with pytest.raises(GrammarError) as info:
        check_grammar(params)
    assert str(info.value).startswith(message)
    assert ".cc:" not in str(info.value)  # xgrammar's source location is stripped


def test_choices_with_quotes_and_non_ascii_parse():
    check_grammar(StructuredOutputsParams(choice=['say "hi"', "café", "back\\slash"]))


# -- scheduling around compiles (tiny pools, a real xgrammar grammar over a 16-token vocabulary) --


def _compiled_regex(pattern: str):
    info = xgr.TokenizerInfo([chr(ord("a") + i) for i in range(16)])  # token i is one letter
    return xgr.GrammarCompiler(info, max_threads=1).compile_regex(pattern)


def test_a_request_waits_for_its_grammar_without_holding_up_others():
    s = make_scheduler()
    a = make_request(list(range(4)), request_id="a", max_tokens=2)
    future: concurrent.futures.Future = concurrent.futures.Future()
    a.grammar = GrammarState(future, deadline=time.monotonic() + 60)
    b = make_request(list(range(10, 14)), request_id="b", max_tokens=2)
    s.add_request(a)
    s.add_request(b)
    out, _ = step(s)
    assert out.num_scheduled_tokens == {"b": 4}
    assert [r.request_id for r in s.waiting] == ["a"]  # still first in line
    future.set_result(_compiled_regex("h+"))  # token 7 is "h"
    out, res = step(s)
    assert out.num_scheduled_tokens == {"b": 1, "a": 4}
    assert {r.request_id: r.new_token_ids for r in res} == {"b": [7], "a": [7]}


def test_a_token_off_the_grammar_ends_the_request():
    s = make_scheduler()
    a = make_request(list(range(4)), request_id="a", max_tokens=4)
    future: concurrent.futures.Future = concurrent.futures.Future()
    future.set_result(_compiled_regex("b+"))  # only token 1 fits; the fake model samples 7
    a.grammar = GrammarState(future, deadline=time.monotonic() + 60)
    s.add_request(a)
    _, res = step(s)
    assert res[0].finish_reason == "abort" and "does not fit the grammar" in res[0].error
    assert res[0].stop_reason is None
    assert s.kv.pool.get_num_free_blocks() == 16


def test_failed_and_timed_out_compiles_are_errors():
    failed: concurrent.futures.Future = concurrent.futures.Future()
    failed.set_exception(RuntimeError("[12:00:00] /project/cpp/x.cc:1: boom"))
    state = GrammarState(failed, deadline=time.monotonic() + 60)
    assert not state.poll(time.monotonic()) and state.error == "grammar compilation failed: boom"
    slow = GrammarState(concurrent.futures.Future(), deadline=time.monotonic() - 1)
    assert not slow.poll(time.monotonic()) and slow.error == "grammar compilation timed out"


# -- the real model ---------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def llm(default_model_dir):
    return LLM(default_model_dir, dtype="bfloat16", kv_cache_memory="128MiB", max_model_len=512)


def chat(llm, question: str, **params):
    params.setdefault("max_tokens", 48)
    params.setdefault("temperature", 0)
    out = llm.chat([[{"role": "user", "content": question}]], SamplingParams(**params))[0]
    return out.outputs


def test_json_schema(llm):
    (out,) = chat(llm, "Describe a person named Ann who is 31 years old.", structured_outputs={"json": PERSON})
    value = json.loads(out.text)
    assert set(value) == {"name", "age"} and isinstance(value["name"], str) and isinstance(value["age"], int)
    assert out.finish_reason == "stop"


def test_any_json_object(llm):
    (out,) = chat(llm, "Describe Paris.", structured_outputs={"json_object": True})
    assert isinstance(json.loads(out.text), dict)


def test_regex(llm):
    (out,) = chat(llm, "Make up a phone number.", structured_outputs={"regex": r"\d{3}-\d{4}"})
    assert re.fullmatch(r"\d{3}-\d{4}", out.text)


def test_choice_stops_when_complete_even_with_ignore_eos(llm):
    (out,) = chat(
        llm,
        "Is Paris in France? Answer yes or no.",
        ignore_eos=True,
        structured_outputs={"choice": ["yes", "no", "maybe"]},
    )
    assert out.text in {"yes", "no", "maybe"} and out.finish_reason == "stop"


def test_grammar(llm):
    grammar = 'root ::= "The answer is " [0-9]+ "."'
    (out,) = chat(llm, "What is 2 plus 2?", structured_outputs={"grammar": grammar})
    assert re.fullmatch(r"The answer is \d+\.", out.text)


def test_sampled_choices_each_follow_the_schema(llm):
    outs = chat(
        llm, "Invent a person.", n=3, temperature=1.0, seed=5, max_tokens=64, structured_outputs={"json": PERSON}
    )
    for out in outs:
        if out.finish_reason == "stop":
            assert set(json.loads(out.text)) == {"name", "age"}
        else:  # cut by max_tokens: still a prefix of the schema's JSON
            assert out.text.startswith('{"name": "')


def test_constrained_and_free_requests_share_a_batch(llm):
    """Bitmask rows follow the runner's sampling order: the free request is unaffected."""
    free = SamplingParams(max_tokens=8, temperature=0)
    alone = llm.generate(["1, 2, 3, 4,"], free)[0].outputs[0].text
    constrained = SamplingParams(max_tokens=8, temperature=0, structured_outputs={"regex": "[a-z]+"})
    outs = llm.generate(["Name a fruit:", "1, 2, 3, 4,", "Name a color:"], [constrained, free, constrained])
    assert outs[1].outputs[0].text == alone
    assert re.fullmatch("[a-z]+", outs[0].outputs[0].text) and re.fullmatch("[a-z]+", outs[2].outputs[0].text)


def test_invalid_grammar_is_refused_before_anything_runs(llm):
    with pytest.raises(ValueError, match="invalid regex constraint"):
        llm.generate(["hi"], SamplingParams(structured_outputs={"regex": "("}))
    assert not llm.engine.has_unfinished_requests()


def test_compile_timeout_ends_the_request_with_its_reason(llm):
    manager = llm.engine.structured_output
    release = threading.Event()
    blocker = manager._executor.submit(release.wait)  # the one compile thread is busy
    saved, manager.timeout_s = manager.timeout_s, 0.2
    try:
        out = llm.generate(["hi"], SamplingParams(structured_outputs={"regex": "[0-9]+"}))[0]
    finally:
        manager.timeout_s = saved
        release.set()
        blocker.result()
    assert out.outputs[0].finish_reason == "abort" and out.outputs[0].token_ids == []
    assert out.outputs[0].error == "grammar compilation timed out" and out.outputs[0].stop_reason is None
    assert not llm.engine.has_unfinished_requests()
