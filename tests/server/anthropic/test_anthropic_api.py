"""Anthropic's Messages API (server/anthropic) through the real `anthropic` SDK and LangChain's
ChatAnthropic, unchanged, against the session's shared real server with the default model:
messages.create, stream (the SDK's event parsing and the raw event sequence), stop sequences,
tools with tool_choice auto / any / tool and a tool_result round trip, count_tokens, x-api-key
auth, and bad input answered with Anthropic's error shape and a 4xx."""

from __future__ import annotations

import pytest

from tests.server.conftest import MODEL, server

anthropic = pytest.importorskip("anthropic")
pydantic = pytest.importorskip("pydantic")
pytestmark = pytest.mark.slow

ASK = [{"role": "user", "content": "What is 2 plus 2?"}]
GREEDY = {"extra_body": {"temperature": 0}}  # the SDK has no sampling arguments any more; the API takes them


class Weather(pydantic.BaseModel, extra="forbid"):
    city: str


WEATHER = {
    "name": "get_weather",
    "description": "Current weather in a city",
    "input_schema": Weather.model_json_schema(),
}
TIME = {
    "name": "get_time",
    "description": "Current time in a time zone",
    "input_schema": {"type": "object", "properties": {"zone": {"type": "string"}}, "required": ["zone"]},
}
MANY = [{"role": "user", "content": "What's the weather in Paris and in London, and the time in Tokyo?"}]


@pytest.fixture(scope="module")
def client(server):
    return anthropic.Anthropic(
        base_url=server.url("inference"), api_key=server.keys["inference"], max_retries=0, timeout=120
    )


def test_create_with_a_system_prompt(client):
    r = client.messages.create(
        model=MODEL, max_tokens=24, **GREEDY, messages=ASK, system="You are a helpful assistant."
    )
    assert r.type == "message" and r.role == "assistant" and r.id.startswith("msg_")
    [block] = r.content
    assert block.type == "text" and "4" in block.text
    assert r.stop_reason in {"end_turn", "max_tokens"} and r.usage.input_tokens > 10 and r.usage.output_tokens > 0
    cut = client.messages.create(model=MODEL, max_tokens=2, **GREEDY, messages=ASK)
    assert cut.stop_reason == "max_tokens" and cut.usage.output_tokens == 2
    stopped = client.messages.create(model=MODEL, max_tokens=24, **GREEDY, messages=ASK, stop_sequences=["4"])
    assert stopped.stop_reason == "stop_sequence" and stopped.stop_sequence == "4"
    assert "4" not in stopped.content[0].text and block.text.startswith(stopped.content[0].text)


def test_stream_matches_the_whole_answer_and_the_event_sequence(client):
    whole = client.messages.create(model=MODEL, max_tokens=24, **GREEDY, messages=ASK)
    with client.messages.stream(model=MODEL, max_tokens=24, **GREEDY, messages=ASK) as stream:
        text = "".join(stream.text_stream)
        final = stream.get_final_message()
    assert text == whole.content[0].text == final.content[0].text
    assert final.stop_reason == whole.stop_reason and final.usage.output_tokens == whole.usage.output_tokens
    events = [e.type for e in client.messages.create(model=MODEL, max_tokens=8, **GREEDY, messages=ASK, stream=True)]
    assert events[:2] == ["message_start", "content_block_start"]
    assert events[-3:] == ["content_block_stop", "message_delta", "message_stop"]
    assert set(events[2:-3]) == {"content_block_delta"}  # the SDK drops the ping


@pytest.mark.parametrize(
    "choice",
    [{"type": "any"}, {"type": "any", "disable_parallel_tool_use": True}, {"type": "tool", "name": "get_weather"}],
)
def test_forced_tool_use_is_complete_and_valid(client, choice):
    r = client.messages.create(
        model=MODEL, max_tokens=200, **GREEDY, messages=MANY, tools=[WEATHER, TIME], tool_choice=choice
    )
    assert r.stop_reason == "tool_use"
    calls = [b for b in r.content if b.type == "tool_use"]
    assert 1 <= len(calls) <= (1 if choice != {"type": "any"} else 2)
    for call in calls:
        assert call.id.startswith("toolu_")
        if call.name == "get_weather":
            Weather.model_validate(call.input)
        else:
            assert call.name == "get_time" and isinstance(call.input["zone"], str)
    if choice["type"] == "tool":
        assert [c.name for c in calls] == ["get_weather"]


def test_tool_round_trip_and_streamed_tool_use(client):
    ask = [{"role": "user", "content": "What is the weather like in Paris?"}]
    kwargs = {
        "model": MODEL,
        "max_tokens": 60,
        "extra_body": {"temperature": 0},
        "tools": [WEATHER],
        "tool_choice": {"type": "tool", "name": "get_weather"},
    }
    r = client.messages.create(messages=ask, **kwargs)
    [call] = [b for b in r.content if b.type == "tool_use"]
    with client.messages.stream(messages=ask, **kwargs) as stream:
        final = stream.get_final_message()
    [streamed] = [b for b in final.content if b.type == "tool_use"]
    assert streamed.name == call.name and streamed.input == call.input and final.stop_reason == "tool_use"
    history = ask + [
        {"role": "assistant", "content": [b.model_dump() for b in r.content]},
        {"role": "user", "content": [{"type": "tool_result", "tool_use_id": call.id, "content": "18 degrees, sunny"}]},
    ]
    answer = client.messages.create(model=MODEL, max_tokens=40, **GREEDY, messages=history, tools=[WEATHER])
    assert answer.content and answer.usage.input_tokens > r.usage.input_tokens + 10


def test_count_tokens_is_the_prompt_the_model_sees(client):
    r = client.messages.create(model=MODEL, max_tokens=2, messages=ASK, system="Be brief.")
    counted = client.messages.count_tokens(model=MODEL, messages=ASK, system="Be brief.")
    assert counted.input_tokens == r.usage.input_tokens
    with_tools = client.messages.count_tokens(model=MODEL, messages=ASK, tools=[WEATHER])
    assert with_tools.input_tokens > counted.input_tokens + 20


def test_auth_with_x_api_key_or_bearer_and_refusals(server):
    bad = anthropic.Anthropic(base_url=server.url("inference"), api_key="wrong", max_retries=0)
    with pytest.raises(anthropic.AuthenticationError) as err:
        bad.messages.create(model=MODEL, max_tokens=2, messages=ASK)
    assert err.value.body["type"] == "error" and err.value.body["error"]["type"] == "authentication_error"
    r = server.post("inference", "/v1/messages", json={"model": MODEL, "max_tokens": 2, "messages": ASK})  # bearer
    assert r.status == 200 and r.json()["type"] == "message"


BAD = [
    ({"model": MODEL, "messages": ASK}, 400, "max_tokens"),
    ({"model": "nosuchmodel", "max_tokens": 5, "messages": ASK}, 404, "nosuchmodel"),
    ({"model": MODEL, "max_tokens": "5", "messages": ASK}, 400, "max_tokens"),
    ({"model": MODEL, "max_tokens": 5, "messages": ASK, "temperature": 1.5}, 400, "temperature"),
    ({"model": MODEL, "max_tokens": 5, "messages": []}, 400, "messages"),
    ({"model": MODEL, "max_tokens": 5, "messages": [{"role": "system", "content": "x"}]}, 400, "role"),
    (
        {
            "model": MODEL,
            "max_tokens": 5,
            "messages": [
                {
                    "role": "user",
                    "content": [{"type": "tool_result", "tool_use_id": "toolu_x", "content": "18 degrees"}],
                }
            ],
        },
        400,
        "tool_use_id",
    ),
    (
        {
            "model": MODEL,
            "max_tokens": 5,
            "messages": [{"role": "user", "content": [{"type": "tool_result", "content": "18 degrees"}]}],
        },
        400,
        "tool_use_id",
    ),
    (
        {
            "model": MODEL,
            "max_tokens": 5,
            "messages": [
                {
                    "role": "user",
                    "content": [
                        {"type": "image", "source": {"type": "base64", "media_type": "image/png", "data": "aGk="}}
                    ],
                }
            ],
        },
        400,
        "image",
    ),
    ({"model": MODEL, "max_tokens": 5, "messages": ASK, "tool_choice": {"type": "any"}}, 400, "tool_choice"),
    (
        {
            "model": MODEL,
            "max_tokens": 5,
            "messages": ASK,
            "tools": [WEATHER],
            "tool_choice": {"type": "tool", "name": "nope"},
        },
        400,
        "nope",
    ),
    ({"model": MODEL, "max_tokens": 5, "messages": ASK, "frobnicate": 1}, 400, "frobnicate"),
]


@pytest.mark.parametrize(("body", "status", "field"), BAD)
def test_bad_bodies_in_anthropics_error_shape(server, body, status, field):
    r = server.post("inference", "/v1/messages", json=body)
    assert r.status == status, r.text
    error = r.json()
    assert error["type"] == "error" and set(error["error"]) == {"type", "message"}, error
    assert error["error"]["type"] == ("not_found_error" if status == 404 else "invalid_request_error")
    assert field in error["error"]["message"]


def test_invalid_json_and_bad_count_tokens(server):
    r = server.request("POST", "inference", "/v1/messages", data=b"{nope", headers={"Content-Type": "application/json"})
    assert r.status == 400 and r.json()["error"]["type"] == "invalid_request_error"
    r = server.post("inference", "/v1/messages/count_tokens", json={"model": MODEL})
    assert r.status == 400 and "messages" in r.json()["error"]["message"]


# -- LangChain's ChatAnthropic ---------------------------------------------------------------


@pytest.fixture(scope="module")
def chat_anthropic(server):
    langchain_anthropic = pytest.importorskip("langchain_anthropic")
    return langchain_anthropic.ChatAnthropic(
        model=MODEL,
        base_url=server.url("inference"),
        api_key=server.keys["inference"],
        **GREEDY,
        max_tokens=40,
        max_retries=0,
    )


def test_langchain_chat_anthropic_invoke_and_stream(chat_anthropic):
    message = chat_anthropic.invoke("What is 2 plus 2?")
    assert "4" in message.content and message.usage_metadata["output_tokens"] > 0
    pieces = list(chat_anthropic.stream("What is 2 plus 2?"))
    assert (
        "".join(
            p.content if isinstance(p.content, str) else "".join(c.get("text", "") for c in p.content) for p in pieces
        )
        == message.content
    )


def test_langchain_chat_anthropic_tools_and_structured_output(chat_anthropic):
    message = chat_anthropic.bind_tools([WEATHER], tool_choice="get_weather").invoke("What is the weather in Paris?")
    [call] = message.tool_calls
    assert call["name"] == "get_weather"
    Weather.model_validate(call["args"])
    forced = chat_anthropic.bind_tools([WEATHER], tool_choice="any").invoke("What is the weather in Paris?")
    assert forced.tool_calls and forced.tool_calls[0]["name"] == "get_weather"
    weather = chat_anthropic.with_structured_output(Weather).invoke("What is the weather in Paris?")
    assert isinstance(weather, Weather) and weather.city


def test_output_config_json_schema(client):
    r = client.messages.create(
        model=MODEL,
        max_tokens=60,
        **GREEDY,
        messages=[{"role": "user", "content": "What is the weather in Paris?"}],
        output_config={"format": {"type": "json_schema", "schema": Weather.model_json_schema()}},
    )
    Weather.model_validate_json(r.content[0].text)
