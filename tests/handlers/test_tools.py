"""Tool calling without a server: the tool fields' checks, the constraint for `required` and a
named function, the default (Hermes-style) prompt, and the parsers on recorded model outputs."""

from __future__ import annotations

import json

import pytest

from pagedserve.engine.request.inputs import PromptSpec
from pagedserve.handlers.base_handler import HandlerError
from pagedserve.handlers.openai_protocol import parse_chat_request
from pagedserve.handlers.openai_tools import ToolParser, parse_output, tool_prompt

WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "Current weather in a city",
        "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]},
    },
}
TIME = {
    "type": "function",
    "function": {"name": "get_time", "parameters": {"type": "object", "properties": {"zone": {"type": "string"}}}},
}
ASK = [{"role": "user", "content": "Weather in Paris?"}]


def chat(**extra):
    return parse_chat_request({"model": "m", "messages": ASK, "tools": [WEATHER, TIME], **extra})


def test_tool_choice_modes_and_their_constraints():
    assert chat().tools.choice == "auto" and chat().params.structured_outputs is None
    assert chat(tool_choice="none").tools is None
    required = chat(tool_choice="required", parallel_tool_calls=False)
    schema = json.loads(required.params.structured_outputs.json)
    assert schema["type"] == "array" and schema["minItems"] == 1 and schema["maxItems"] == 1
    assert [c["properties"]["name"]["const"] for c in schema["items"]["anyOf"]] == ["get_weather", "get_time"]
    # Parallel calls: at most one per offered tool, so the list (and the answer) ends by itself.
    assert json.loads(chat(tool_choice="required").params.structured_outputs.json)["maxItems"] == 2
    named = chat(tool_choice={"type": "function", "function": {"name": "get_weather"}})
    assert json.loads(named.params.structured_outputs.json) == WEATHER["function"]["parameters"]


@pytest.mark.parametrize(
    "extra, words",
    [
        ({"tool_choice": {"type": "function", "function": {"name": "nope"}}}, ["tool_choice", "nope"]),
        ({"tool_choice": "sometimes"}, ["tool_choice"]),
        ({"tools": [WEATHER, WEATHER]}, ["tools", "unique"]),
        ({"tools": [{"type": "function", "function": {"name": "bad name!"}}]}, ["tools"]),
        ({"tools": [{"type": "retrieval"}]}, ["tools"]),
        ({"tool_choice": "required", "response_format": {"type": "json_object"}}, ["tool_choice", "structured"]),
        ({"tools": None, "tool_choice": "required"}, ["tool_choice", "tools"]),
        ({"function_call": "auto"}, ["function_call"]),
    ],
)
def test_tool_refusals_name_the_field(extra, words):
    with pytest.raises(HandlerError) as err:
        parse_chat_request({"model": "m", "messages": ASK, "tools": [WEATHER], **extra})
    assert all(w in str(err.value) for w in words), str(err.value)


def test_history_with_tool_calls_and_tool_results_renders_by_default_as_hermes():
    history = ASK + [
        {
            "role": "assistant",
            "content": None,
            "tool_calls": [
                {
                    "id": "call_1",
                    "type": "function",
                    "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'},
                }
            ],
        },
        {"role": "tool", "tool_call_id": "call_1", "content": "18 C, sunny"},
    ]
    req = parse_chat_request({"model": "m", "messages": history, "tools": [WEATHER]})
    spec = tool_prompt(req.prompts[0], req.tools, chat_template="{{ messages }}")  # no tools section
    system, user, assistant, tool = spec.messages
    assert system["role"] == "system" and "<tools>" in system["content"] and '"get_weather"' in system["content"]
    assert user == {"role": "user", "content": "Weather in Paris?"}
    assert assistant["content"] == '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>'
    assert tool == {"role": "user", "content": "<tool_response>\n18 C, sunny\n</tool_response>"}
    assert spec.tools is None
    # A template with a tools section gets the tools and the turns as Hugging Face templates read them.
    native = tool_prompt(req.prompts[0], req.tools, chat_template="{% for t in tools %}{% endfor %}")
    assert native.tools == [WEATHER] and native.messages[1]["tool_calls"][0]["function"]["arguments"] == {
        "city": "Paris"
    }
    with pytest.raises(HandlerError) as err:
        parse_chat_request(
            {
                "model": "m",
                "messages": ASK
                + [
                    {
                        "role": "assistant",
                        "tool_calls": [
                            {"id": "c", "type": "function", "function": {"name": "f", "arguments": "{not json"}}
                        ],
                    }
                ],
            }
        )
    assert "arguments" in str(err.value)
    assert tool_prompt(PromptSpec(messages=ASK), None, None).messages == ASK  # nothing to do


# Outputs as models write them (recorded), with the calls each parser must find.
RECORDED = [
    (
        ToolParser.HERMES,
        (
            'Let me check.\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n'
            '</tool_call>\n<tool_call>\n{"name": "get_time", "arguments": {"zone": "CET"}}\n</tool_call>'
        ),
        "Let me check.",
        [("get_weather", {"city": "Paris"}), ("get_time", {"zone": "CET"})],
    ),
    (
        ToolParser.HERMES,
        '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Oslo"}}',
        None,
        [("get_weather", {"city": "Oslo"})],
    ),  # stopped at </tool_call> as a stop string
    (ToolParser.HERMES, "It is sunny in Paris.", "It is sunny in Paris.", []),
    (
        ToolParser.LLAMA3_JSON,
        (
            '<|python_tag|>{"name": "get_weather", "parameters": {"city": "Rome"}}; '
            '{"name": "get_time", "parameters": {}}'
        ),
        None,
        [("get_weather", {"city": "Rome"}), ("get_time", {})],
    ),
    (ToolParser.LLAMA3_JSON, "Rome is warm.", "Rome is warm.", []),
    (
        ToolParser.PYTHONIC,
        '[get_weather(city="Lima"), get_time(zone="PET")]',
        None,
        [("get_weather", {"city": "Lima"}), ("get_time", {"zone": "PET"})],
    ),
    (ToolParser.PYTHONIC, "[1, 2, 3]", "[1, 2, 3]", []),
    (
        ToolParser.HERMES,
        '<tool_call>\n{"name": "get_weather", "argu',
        '<tool_call>\n{"name": "get_weather", "argu',
        [],
    ),  # cut off by max_tokens: no call, the text stays
]


@pytest.mark.parametrize("parser, text, content, calls", RECORDED)
def test_auto_parsers_on_recorded_outputs(parser, text, content, calls):
    tools = chat().tools
    parsed = parse_output(text, tools, parser)
    assert parsed.content == content
    assert [(c.name, json.loads(c.arguments)) for c in parsed.calls] == calls
    assert all(c.id.startswith("call_") for c in parsed.calls)


def test_required_and_named_outputs_are_read_as_json():
    required = chat(tool_choice="required").tools
    [call] = parse_output('[{"name":"get_weather","arguments":{"city":"Paris"}}]', required, ToolParser.HERMES).calls
    assert (call.name, json.loads(call.arguments)) == ("get_weather", {"city": "Paris"})
    cut = parse_output(
        '[{"name":"get_weather","arguments":{"city":"Paris"}}, {"name":"get_ti', required, ToolParser.HERMES
    )  # max_tokens cut the list: its complete calls stand
    assert [c.name for c in cut.calls] == ["get_weather"] and cut.content is None
    assert parse_output('[{"name":"get_wea', required, ToolParser.HERMES).calls == []
    named = chat(tool_choice={"type": "function", "function": {"name": "get_time"}}).tools
    [call] = parse_output('{"zone":"UTC"}', named, ToolParser.PYTHONIC).calls
    assert (call.name, call.arguments) == ("get_time", '{"zone":"UTC"}')


def test_streamed_calls_are_sent_as_openai_streams_them_and_the_sdk_reassembles_them():
    streaming = pytest.importorskip("openai.lib.streaming.chat")
    from openai.types.chat import ChatCompletionChunk

    from pagedserve.engine.request.outputs import CompletionOutput, FinishReason, RequestOutput
    from pagedserve.handlers.deltas import DeltaTracker
    from pagedserve.handlers.openai_responses import OpenAIFormatter

    text = (
        '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris, France", "days": 2}}\n</tool_call>'
        '<tool_call>\n{"name": "get_time", "arguments": {"zone": "UTC"}}\n</tool_call>'
    )
    formatter = OpenAIFormatter(chat(stream=True), "chatcmpl-1", "m", 1)
    tracker, chunks = DeltaTracker(), [formatter.first_chunk(1)]
    for end in (10, 40, len(text)):  # held while the choice runs: no chunk until it finishes
        out = RequestOutput("r", None, [1], [CompletionOutput(0, text[:end], [1] * end)])
        if end == len(text):
            out.outputs[0].finish_reason, out.finished = FinishReason.STOP, True
        sent = formatter.delta_chunks(tracker.update(out))
        assert bool(sent) == out.finished
        chunks += sent
    deltas = [c["choices"][0]["delta"] for c in chunks[1:]]
    head = deltas[0]["tool_calls"][0]
    assert head["index"] == 0 and head["id"].startswith("call_") and head["type"] == "function"
    assert head["function"] == {"name": "get_weather", "arguments": ""}
    pieces = [d["tool_calls"][0]["function"]["arguments"] for d in deltas[1:4]]
    assert pieces == ['{"city": "Paris,', ' France",', ' "days": 2}']  # fragments after the head
    assert all(set(d["tool_calls"][0]) == {"index", "function"} for d in deltas[1:4])
    assert deltas[4]["tool_calls"][0]["function"]["name"] == "get_time" and deltas[-1] == {}
    assert [c["choices"][0]["finish_reason"] for c in chunks] == [None] * (len(chunks) - 1) + ["tool_calls"]
    state = streaming.ChatCompletionStreamState()
    for chunk in chunks:
        state.handle_chunk(ChatCompletionChunk.model_validate(chunk))
    [choice] = state.get_final_completion().choices
    assert [(c.function.name, json.loads(c.function.arguments)) for c in choice.message.tool_calls] == [
        ("get_weather", {"city": "Paris, France", "days": 2}),
        ("get_time", {"zone": "UTC"}),
    ]
    assert choice.finish_reason == "tool_calls" and not choice.message.content
