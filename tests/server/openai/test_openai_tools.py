"""Tool calling through the official `openai` SDK against a real server with the default model:
`tool_choice: required` and a named function return calls whose arguments validate against the
tool's schema, a round trip with a `tool` message, a streamed call (a head delta, then argument
fragments, as OpenAI streams calls) reassembled by the SDK; and
LangChain's `bind_tools` and LiteLLM's `completion` with tools against the same server."""

from __future__ import annotations

import json
from typing import Literal

import pytest

from tests.server.conftest import MODEL
from tests.server.openai_fixtures import client, server  # noqa: F401 -- fixtures

openai = pytest.importorskip("openai")
jsonschema = pytest.importorskip("jsonschema")
pydantic = pytest.importorskip("pydantic")
pytestmark = pytest.mark.slow


class Weather(pydantic.BaseModel, extra="forbid"):
    city: str
    unit: Literal["celsius", "fahrenheit"]


TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "get_weather",
            "description": "Current weather in a city",
            "parameters": Weather.model_json_schema(),
        },
    },
    {
        "type": "function",
        "function": {
            "name": "get_time",
            "description": "Current time in a time zone",
            "parameters": {
                "type": "object",
                "properties": {"zone": {"type": "string"}},
                "required": ["zone"],
                "additionalProperties": False,
            },
        },
    },
]
ASK = [{"role": "user", "content": "What is the weather like in Paris today?"}]


def test_required_tool_call_validates_against_the_schema(client):
    r = client.chat.completions.create(
        model=MODEL,
        messages=ASK,
        tools=TOOLS,
        tool_choice="required",
        parallel_tool_calls=False,
        max_tokens=60,
        temperature=0,
    )
    [choice] = r.choices
    assert choice.finish_reason == "tool_calls" and choice.message.content is None
    [call] = choice.message.tool_calls
    assert call.type == "function" and call.id.startswith("call_")
    assert call.function.name in {"get_weather", "get_time"}
    if call.function.name == "get_weather":
        Weather.model_validate_json(call.function.arguments)
    else:
        assert isinstance(json.loads(call.function.arguments)["zone"], str)


def _valid_call(call) -> None:
    """A call of one of TOOLS whose arguments validate against that tool's schema."""
    if call.function.name == "get_weather":
        Weather.model_validate_json(call.function.arguments)
    else:
        assert call.function.name == "get_time"
        jsonschema.validate(json.loads(call.function.arguments), TOOLS[1]["function"]["parameters"])


MANY = [{"role": "user", "content": "What's the weather in Paris and in London, and the time in Tokyo?"}]


@pytest.mark.parametrize("parallel", [None, True, False])
@pytest.mark.parametrize("choice", ["required", "get_weather"])
@pytest.mark.parametrize("tools", [TOOLS, TOOLS[:1]], ids=["two-tools", "one-tool"])
def test_forced_tool_calls_end_by_themselves(client, tools, choice, parallel):
    """`required` and a named function, with parallel_tool_calls unset, true or false and no
    max_tokens: the grammar ends the answer after the call list. Before issue 29 the default
    model answered this prompt with call after call until the limit: no tool_calls and
    finish_reason "length"."""
    kwargs = {} if parallel is None else {"parallel_tool_calls": parallel}
    tool_choice = choice if choice == "required" else {"type": "function", "function": {"name": choice}}
    r = client.chat.completions.create(
        model=MODEL, messages=MANY, tools=tools, tool_choice=tool_choice, temperature=0, **kwargs
    )
    [choice_out] = r.choices
    assert choice_out.finish_reason == "tool_calls", choice_out
    calls = choice_out.message.tool_calls
    assert 1 <= len(calls) <= (1 if parallel is False or choice != "required" else len(tools))
    for call in calls:
        _valid_call(call)
    if choice != "required":
        assert [c.function.name for c in calls] == [choice]
    assert r.usage.completion_tokens < 100  # it stopped at the end of the list, not at a limit


def test_named_function_and_a_round_trip_with_the_tool_result(client):
    r = client.chat.completions.create(
        model=MODEL,
        messages=ASK,
        tools=TOOLS,
        max_tokens=60,
        temperature=0,
        tool_choice={"type": "function", "function": {"name": "get_weather"}},
    )
    [call] = r.choices[0].message.tool_calls
    assert call.function.name == "get_weather" and r.choices[0].finish_reason == "tool_calls"
    weather = Weather.model_validate_json(call.function.arguments)
    history = ASK + [
        r.choices[0].message.model_dump(exclude_none=True),
        {"role": "tool", "tool_call_id": call.id, "content": f"18 degrees {weather.unit}, sunny"},
    ]
    answer = client.chat.completions.create(
        model=MODEL, messages=history, tools=TOOLS, tool_choice="none", max_tokens=40, temperature=0
    )
    assert answer.choices[0].message.content and answer.choices[0].message.tool_calls is None
    plain = client.chat.completions.create(model=MODEL, messages=ASK, max_tokens=1).usage.prompt_tokens
    assert answer.usage.prompt_tokens > plain + 20  # the call and its result are in the prompt


def test_streamed_tool_call_reassembled_by_the_sdk(client):
    kwargs = {
        "model": MODEL,
        "messages": ASK,
        "tools": TOOLS,
        "max_tokens": 60,
        "temperature": 0,
        "tool_choice": {"type": "function", "function": {"name": "get_weather"}},
    }
    with client.chat.completions.stream(**kwargs) as stream:
        chunks = [event.chunk for event in stream if event.type == "chunk"]
        final = stream.get_final_completion()
    calls = [call for c in chunks for choice in c.choices for call in choice.delta.tool_calls or ()]
    head, pieces = calls[0], calls[1:]  # as OpenAI streams a call: its head, then argument fragments
    assert head.id.startswith("call_") and head.type == "function" and head.index == 0
    assert head.function.name == "get_weather" and head.function.arguments == ""
    assert pieces and all(p.index == 0 and p.id is None and p.function.name is None for p in pieces)
    [call] = final.choices[0].message.tool_calls
    assert call.id == head.id and call.function.arguments == "".join(p.function.arguments for p in pieces)
    Weather.model_validate_json(call.function.arguments)  # the SDK's reassembly validates
    assert final.choices[0].finish_reason == "tool_calls"


def test_auto_answers_with_text_or_a_parsed_call(client):
    r = client.chat.completions.create(model=MODEL, messages=ASK, tools=TOOLS, max_tokens=60, temperature=0)
    message = r.choices[0].message
    if message.tool_calls:  # the small model may or may not call; either way the reply is well formed
        assert r.choices[0].finish_reason == "tool_calls"
        assert all(c.function.name in {"get_weather", "get_time"} for c in message.tool_calls)
    else:
        assert message.content and r.choices[0].finish_reason in {"stop", "length"}


def test_langchain_bind_tools(server):
    langchain_openai = pytest.importorskip("langchain_openai")
    llm = langchain_openai.ChatOpenAI(
        model=MODEL,
        base_url=server.url("inference", "/v1"),
        api_key=server.keys["inference"],
        temperature=0,
        max_tokens=60,
        max_retries=0,
    )
    weather = TOOLS[0]
    message = llm.bind_tools([weather], tool_choice="get_weather").invoke("What is the weather like in Paris?")
    [call] = message.tool_calls
    assert call["name"] == "get_weather" and call["id"].startswith("call_")
    Weather.model_validate(call["args"])


def test_litellm_completion_with_tools(server, monkeypatch):
    monkeypatch.setenv("LITELLM_LOCAL_MODEL_COST_MAP", "True")  # no network at import
    litellm = pytest.importorskip("litellm")
    r = litellm.completion(
        model=f"openai/{MODEL}",
        api_base=server.url("inference", "/v1"),
        api_key=server.keys["inference"],
        messages=ASK,
        tools=TOOLS,
        tool_choice="required",
        parallel_tool_calls=False,
        max_tokens=60,
        temperature=0,
    )
    [call] = r.choices[0].message.tool_calls
    assert r.choices[0].finish_reason == "tool_calls" and call.function.name in {"get_weather", "get_time"}
    assert isinstance(json.loads(call.function.arguments), dict)


def test_auto_lets_the_default_model_write_text_then_a_call_that_validates(client):
    """`tool_choice: "auto"` with the default model (SmolLM2, the Hermes preamble): text is
    free, and once the model writes `<tool_call>` the structural tag binds the call to the
    tool's schema (pagedserve.handlers.tool_tags). Sampled, seeded: some choices answer in
    text only, some write text and then a call; every call validates."""
    r = client.chat.completions.create(
        model=MODEL,
        messages=[
            {
                "role": "user",
                "content": "What is the weather like in Paris today? Say what you will do, then call the tool.",
            }
        ],
        tools=TOOLS[:1],
        tool_choice="auto",
        parallel_tool_calls=False,
        temperature=0.7,
        seed=1,
        n=8,
        max_tokens=80,
        # "<" and " <" (where the trigger starts) made likelier: a 135M model rarely opens a
        # call by itself; what follows the trigger is the grammar's, not the bias's
        logit_bias={"44": 3, "2067": 3},
    )
    both = 0
    for choice in r.choices:
        for call in choice.message.tool_calls or ():
            _valid_call(call)
        both += bool(choice.message.tool_calls and choice.message.content)
    assert both >= 1, [c.message for c in r.choices]
