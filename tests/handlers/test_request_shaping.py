"""Request parsing and response shaping without an engine: /predictions and OpenAI bodies ->
prompts + SamplingParams (400s naming the field), the real tokenizer's chat template, stream
deltas that hold back possible stop strings, and OpenAI response shapes."""

from __future__ import annotations

import pytest

from pagedserve.engine.model.tokenizer import load_tokenizer
from pagedserve.engine.request.inputs import render_prompt
from pagedserve.engine.request.outputs import CompletionOutput, RequestMetrics, RequestOutput, TokenLogprob
from pagedserve.engine.structured_output.params import StructuredOutputsParams
from pagedserve.handlers.base_handler import HandlerError
from pagedserve.handlers.deltas import DeltaTracker, held_back
from pagedserve.handlers.llm_input import decode_body, parse_predictions_body
from pagedserve.handlers.openai_protocol import Endpoint, parse_chat_request, parse_completion_request, split_model
from pagedserve.handlers.openai_responses import OpenAIFormatter


@pytest.fixture(scope="module")
def tokenizer(default_model_dir):
    return load_tokenizer(default_model_dir)


CHAT = [{"role": "user", "content": "hi"}]


@pytest.mark.parametrize(
    "body, words",
    [
        ({"prompt": "x", "frobnicate": 1}, ["frobnicate"]),
        ({"prompt": "x", "messages": CHAT}, ["exactly one"]),
        ({}, ["exactly one"]),
        ({"prompt": 5}, ["prompt"]),
        ({"prompt": []}, ["prompt"]),
        ({"prompt": "x", "temperature": "hot"}, ["temperature"]),
        ({"prompt": "x", "temperature": -1}, ["temperature"]),
        ({"prompt": "x", "max_tokens": 0}, ["max_tokens"]),
        ({"prompt": "x", "top_p": 0}, ["top_p"]),
        ({"prompt": "x", "n": True}, ["n"]),
        ({"prompt": "x", "stream": "yes"}, ["stream"]),
        ({"messages": [{"role": "robot", "content": "x"}]}, ["role"]),
        ({"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {}}]}]}, ["text parts"]),
    ],
)
def test_predictions_body_refusals_name_the_field(body, words):
    with pytest.raises(HandlerError) as err:
        parse_predictions_body(body)
    assert err.value.code == 400 and all(w in str(err.value) for w in words), str(err.value)


def test_decode_body_refuses_non_objects():
    for raw, word in [(b"{not json", "JSON"), (b"[1, 2]", "object"), (b"\xff\xfe", "UTF-8")]:
        with pytest.raises(HandlerError, match=word):
            decode_body(raw)


def test_predictions_body_and_chat_template(tokenizer):
    parsed = parse_predictions_body(
        {
            "messages": [{"role": "user", "content": [{"type": "text", "text": "2+2?"}]}],
            "max_tokens": 5,
            "temperature": 0,
            "stream": True,
            "stop": "\n",
        }
    )
    assert parsed.stream and parsed.params.max_tokens == 5 and parsed.params.stop == ["\n"]
    text, ids = render_prompt(tokenizer, parsed.prompt)
    assert text.endswith("<|im_start|>assistant\n") and "2+2?" in text
    assert ids == tokenizer.encode(text, add_special_tokens=False)
    ids_only = parse_predictions_body({"prompt": [1, 2, 3]})
    assert render_prompt(tokenizer, ids_only.prompt) == (None, [1, 2, 3])


@pytest.mark.parametrize(
    "body, words",
    [
        ({"model": "m"}, ["prompt", "required"]),
        ({"model": "m", "prompt": "x", "frobnicate": 1}, ["unknown field", "frobnicate"]),
        ({"model": "m", "prompt": "x", "echo": True, "logprobs": 1}, ["echo", "logprobs"]),
        ({"model": "m", "prompt": "x", "suffix": "y"}, ["suffix"]),
        ({"model": "m", "prompt": "x", "logit_bias": {"a": 5}}, ["logit_bias", "token ids"]),
        ({"model": "m", "prompt": "x", "logit_bias": {"1": 101}}, ["logit_bias", "<= 100"]),
        ({"model": "m", "prompt": "x", "best_of": 3}, ["best_of"]),
        ({"model": "m", "prompt": ["a"] * 33}, ["prompt", "1 .. 32"]),
        ({"model": "m", "prompt": ["a", []]}, ["prompt[1]"]),
        ({"model": "m", "prompt": "x", "logprobs": 21}, ["logprobs"]),
        ({"model": "m", "prompt": "x", "logprobs": True}, ["logprobs"]),
        ({"model": "m", "prompt": "x", "max_tokens": "3"}, ["max_tokens"]),
        ({"model": "m", "prompt": "x", "stop": [""]}, ["stop"]),
        ({"model": "m", "prompt": "x", "n": 0}, ["n"]),
        ({"model": "m", "prompt": "x", "n": 1000}, ["n"]),
        ({"model": "m", "prompt": "x", "seed": 1.5}, ["seed"]),
        ({"model": "m", "prompt": "x", "stream_options": {"include_usage": True}}, ["stream_options"]),
        ({"model": 3, "prompt": "x"}, ["model"]),
    ],
)
def test_completion_refusals(body, words):
    with pytest.raises(HandlerError) as err:
        parse_completion_request(body)
    assert all(w in str(err.value) for w in words), str(err.value)


@pytest.mark.parametrize(
    "body, words",
    [
        ({"model": "m"}, ["messages", "required"]),
        ({"model": "m", "messages": []}, ["messages"]),
        ({"model": "m", "messages": CHAT, "tools": [{"type": "function"}]}, ["tools"]),
        ({"model": "m", "messages": CHAT, "tool_choice": "auto"}, ["tool_choice"]),
        ({"model": "m", "messages": CHAT, "response_format": {"type": "xml"}}, ["response_format"]),
        ({"model": "m", "messages": CHAT, "response_format": {"type": "json_schema"}}, ["json_schema", "schema"]),
        (
            {"model": "m", "messages": CHAT, "response_format": {"type": "json_object"}, "guided_regex": "a"},
            ["one structured-output field", "guided_regex, response_format"],
        ),
        ({"model": "m", "messages": CHAT, "guided_choice": []}, ["guided_choice", "must not be empty"]),
        ({"model": "m", "messages": CHAT, "structured_outputs": {"json": {}, "regex": "a"}}, ["exactly one"]),
        ({"model": "m", "messages": CHAT, "structured_outputs": "json"}, ["structured_outputs", "object"]),
        ({"model": "m", "messages": CHAT, "top_logprobs": 2}, ["logprobs"]),
        ({"model": "m", "messages": CHAT, "logprobs": 3}, ["logprobs"]),
        ({"model": "m", "messages": CHAT, "max_tokens": 3, "max_completion_tokens": 4}, ["disagree"]),
        ({"model": "m", "messages": CHAT, "prompt": "x"}, ["unknown field", "prompt"]),
        ({"model": "m", "messages": CHAT, "presence_penalty": 3}, ["presence_penalty"]),
    ],
)
def test_chat_refusals(body, words):
    with pytest.raises(HandlerError) as err:
        parse_chat_request(body)
    assert all(w in str(err.value) for w in words), str(err.value)


def test_openai_requests_map_to_sampling_params():
    req = parse_completion_request(
        {
            "model": "m@2.0",
            "prompt": ["only one"],
            "max_tokens": 7,
            "n": 2,
            "seed": 4,
            "stop": "x",
            "logprobs": 2,
            "top_k": 5,
            "user": "u",
            "temperature": None,
            "stream": True,
            "stream_options": {"include_usage": True},
        }
    )
    assert req.endpoint is Endpoint.COMPLETIONS and [p.text for p in req.prompts] == ["only one"]
    p = req.params
    assert (p.max_tokens, p.n, p.seed, p.stop, p.logprobs, p.top_k, p.temperature) == (7, 2, 4, ["x"], 2, 5, 1.0)
    assert req.stream and req.include_usage and req.logprobs and req.top_logprobs == 2
    assert split_model(req.model) == ("m", "2.0") and split_model("m") == ("m", None)
    assert parse_completion_request({"model": "m", "prompt": "x"}).params.max_tokens == 16  # OpenAI's default
    chat = parse_chat_request(
        {
            "model": "m",
            "messages": CHAT,
            "max_completion_tokens": 9,
            "logprobs": True,
            "top_logprobs": 3,
            "response_format": {"type": "text"},
            "tool_choice": "none",
        }
    )
    assert chat.params.max_tokens == 9 and chat.params.logprobs == 3 and chat.top_logprobs == 3
    assert parse_chat_request({"model": "m", "messages": CHAT}).params.max_tokens is None  # up to the context


@pytest.mark.parametrize(
    "extra, expected",
    [
        ({"response_format": {"type": "json_object"}}, StructuredOutputsParams(json_object=True)),
        (
            {
                "response_format": {
                    "type": "json_schema",
                    "json_schema": {"name": "p", "schema": {"type": "object"}, "strict": True},
                }
            },
            StructuredOutputsParams(json={"type": "object"}),
        ),
        ({"guided_json": {"type": "string"}}, StructuredOutputsParams(json={"type": "string"})),
        ({"guided_regex": "[0-9]+"}, StructuredOutputsParams(regex="[0-9]+")),
        ({"guided_choice": ["a", "b"]}, StructuredOutputsParams(choice=["a", "b"])),
        ({"guided_grammar": 'root ::= "x"'}, StructuredOutputsParams(grammar='root ::= "x"')),
        ({"structured_outputs": {"regex": "a+"}}, StructuredOutputsParams(regex="a+")),
        ({"response_format": {"type": "text"}, "guided_regex": "a"}, StructuredOutputsParams(regex="a")),
    ],
)
def test_structured_output_fields_map_to_one_constraint(extra, expected):
    assert parse_chat_request({"model": "m", "messages": CHAT, **extra}).params.structured_outputs == expected
    assert parse_completion_request({"model": "m", "prompt": "x", **extra}).params.structured_outputs == expected


def _output(texts, finished=False, reasons=None, logprobs=None):
    outs = [
        CompletionOutput(i, t, list(range(len(t))), (reasons or [None] * len(texts))[i], logprobs=logprobs)
        for i, t in enumerate(texts)
    ]
    return RequestOutput(
        "r",
        "p",
        [1, 2, 3],
        outs,
        finished=finished,
        num_cached_tokens=2,
        metrics=RequestMetrics(arrival_time=1.0, first_scheduled_time=1.01, first_token_time=1.03, finished_time=1.33),
    )


def test_deltas_hold_back_possible_stop_strings():
    assert held_back("abc EN", ["END"]) == 2 and held_back("abc", ["END"]) == 0
    tracker = DeltaTracker(["END"])
    d1 = tracker.update(_output(["Hello E"]))
    assert d1[0].text == "Hello " and d1[0].token_ids == list(range(7))
    d2 = tracker.update(_output(["Hello Ex"]))
    assert d2[0].text == "Ex" and d2[0].text_offset == 6 and d2[0].token_ids == [7]
    d3 = tracker.update(_output(["Hello Ex"], finished=True, reasons=["stop"]))
    assert d3[0].text == "" and d3[0].finish_reason == "stop"
    assert tracker.update(_output(["Hello Ex"], finished=True, reasons=["stop"])) == []  # said once


def test_openai_shapes():
    lp = [{7: TokenLogprob(-0.5, 2, "a"), 8: TokenLogprob(-0.1, 1, "b"), 9: TokenLogprob(-2.0, 3, "c")}]
    out = _output(["a"], finished=True, reasons=["length"], logprobs=lp)
    chat = OpenAIFormatter(
        parse_chat_request({"model": "m", "messages": CHAT, "logprobs": True, "top_logprobs": 1}),
        "chatcmpl-1",
        "m",
        123,
    )
    body = chat.response(out, total_s=0.5)
    assert body["object"] == "chat.completion" and body["choices"][0]["message"] == {
        "role": "assistant",
        "content": "a",
    }
    content = body["choices"][0]["logprobs"]["content"][0]
    assert content["token"] == "a" and content["logprob"] == -0.5 and content["bytes"] == [97]
    assert [t["token"] for t in content["top_logprobs"]] == ["b"]
    assert body["usage"] == {
        "prompt_tokens": 3,
        "completion_tokens": 1,
        "total_tokens": 4,
        "prompt_tokens_details": {"cached_tokens": 2},
    }
    assert body["timings"]["ttft_s"] == 0.03 and body["timings"]["cached_prompt_tokens"] == 2
    cmpl = OpenAIFormatter(
        parse_completion_request(
            {"model": "m", "prompt": "x", "logprobs": 2, "stream": True, "stream_options": {"include_usage": True}}
        ),
        "cmpl-1",
        "m",
        1,
    )
    deltas = DeltaTracker().update(out)
    [chunk] = cmpl.delta_chunks(deltas)
    assert chunk["object"] == "text_completion" and chunk["usage"] is None
    logprobs = chunk["choices"][0]["logprobs"]
    assert logprobs["tokens"] == ["a"] and logprobs["top_logprobs"] == [{"b": -0.1, "a": -0.5}]
    assert cmpl.usage_chunk(out)["choices"] == [] and cmpl.first_chunk(1) is None
    assert chat.first_chunk(2)["choices"][1]["delta"] == {"role": "assistant", "content": ""}
