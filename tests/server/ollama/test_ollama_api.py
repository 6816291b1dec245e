"""Ollama's API (server/ollama) through the real `ollama` Python client and LangChain's
ChatOllama, unchanged, against the session's shared real server with the default model: chat,
generate, NDJSON streaming, timing fields in nanoseconds, embed, list, show, ps, tools, `format`
with a JSON schema; bad input answered in Ollama's `{"error": ...}` shape with a 4xx. The
keep-alive and unload seen in `ps` run on an in-process server over the tiny model loaded on
demand (test_ollama_keep_alive.py)."""

from __future__ import annotations

import json

import pytest

from tests.server.conftest import MODEL, server

ollama = pytest.importorskip("ollama")
pydantic = pytest.importorskip("pydantic")
pytestmark = pytest.mark.slow

ASK = [{"role": "user", "content": "What is 2 plus 2?"}]
GREEDY = {"temperature": 0, "num_predict": 24}


class City(pydantic.BaseModel):
    name: str
    country: str


WEATHER_TOOL = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "Current weather in a city",
        "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]},
    },
}


@pytest.fixture(scope="module")
def client(server):
    return ollama.Client(host=server.url("inference"), headers={"Authorization": f"Bearer {server.keys['inference']}"})


def _check_durations(r) -> None:
    """Ollama's timing fields: nanoseconds, consistent with each other."""
    assert r.done and r.done_reason in {"stop", "length"}
    assert r.prompt_eval_count > 0 and r.eval_count > 0
    assert r.total_duration >= r.prompt_eval_duration > 0 and r.eval_duration > 0
    assert r.total_duration >= r.eval_duration and r.load_duration >= 0
    assert r.total_duration < 600 * 10**9  # nanoseconds of a request that took seconds


def test_chat_and_generate(client):
    r = client.chat(model=MODEL, messages=ASK, options=GREEDY)
    assert r.message.role == "assistant" and "4" in r.message.content
    _check_durations(r)
    g = client.generate(model=MODEL, prompt="1, 2, 3, 4,", raw=True, options={"temperature": 0, "num_predict": 6})
    assert g.response == " 5, 6," and g.eval_count == 6 and g.done_reason == "length"
    _check_durations(g)
    templated = client.generate(model=MODEL, prompt="What is 2 plus 2?", options=GREEDY)
    assert templated.response == r.message.content  # the chat template applied, as Ollama does


def test_streamed_chat_and_generate_add_up(client):
    whole = client.chat(model=MODEL, messages=ASK, options=GREEDY)
    chunks = list(client.chat(model=MODEL, messages=ASK, options=GREEDY, stream=True))
    assert len(chunks) > 2 and not any(c.done for c in chunks[:-1]) and chunks[-1].done
    assert "".join(c.message.content for c in chunks) == whole.message.content
    _check_durations(chunks[-1])
    parts = list(
        client.generate(
            model=MODEL, prompt="1, 2, 3, 4,", raw=True, stream=True, options={"temperature": 0, "num_predict": 6}
        )
    )
    assert "".join(p.response for p in parts) == " 5, 6," and parts[-1].eval_count == 6


def test_options_map_onto_sampling(client):
    stopped = client.generate(
        model=MODEL,
        prompt="1, 2, 3, 4,",
        raw=True,
        options={"temperature": 0, "num_predict": 20, "stop": [" 7"], "mirostat": 2},
    )
    assert stopped.response == " 5, 6," and stopped.done_reason == "stop"  # unknown options ignored
    seeded = [
        client.generate(
            model=MODEL,
            prompt="Once upon a time",
            raw=True,
            options={
                "seed": 7,
                "temperature": 1.0,
                "top_k": 40,
                "top_p": 0.9,
                "min_p": 0.05,
                "repeat_penalty": 1.1,
                "num_predict": 8,
            },
        ).response
        for _ in range(2)
    ]
    assert seeded[0] == seeded[1] and seeded[0]


def test_embed_and_the_older_embeddings(client):
    r = client.embed(model=MODEL, input=["The cat sat.", "The cat sat.", "Stock prices fell."])
    a, b, c = r.embeddings
    assert len(a) == 576 and a == b and a != c
    assert r.prompt_eval_count > 0 and r.total_duration > 0
    one = client.embeddings(model=MODEL, prompt="The cat sat.")
    assert len(one.embedding) == 576
    assert sum(x * y for x, y in zip(one.embedding, a)) == pytest.approx(
        sum(x * x for x in a) ** 0.5 * sum(y * y for y in one.embedding) ** 0.5, rel=1e-3
    )


def test_list_show_ps_version(client, server):
    names = {m.model for m in client.list().models}
    assert {f"{MODEL}:latest", f"{MODEL}:1.0"} <= names
    shown = client.show(MODEL)
    assert "default_max_tokens 1024" in shown.parameters and "num_ctx 2048" in shown.parameters
    assert "tools" in shown.capabilities and shown.modelinfo["general.architecture"] == "llama"
    assert shown.template and shown.details.family == "llama"
    [loaded] = [m for m in client.ps().models if m.model == f"{MODEL}:1.0"]
    assert loaded.size > 100_000_000 and loaded.context_length == 2048
    r = server.get("inference", "/api/version")
    assert r.status == 200 and r.json()["version"]


def test_format_with_a_json_schema_and_json(client):
    r = client.chat(
        model=MODEL,
        messages=[{"role": "user", "content": "Name a city in France."}],
        format=City.model_json_schema(),
        options={"temperature": 0},
    )
    City.model_validate_json(r.message.content)
    g = client.generate(model=MODEL, prompt="Describe Paris as JSON.", format="json", options={"temperature": 0})
    assert isinstance(json.loads(g.response), dict)


def test_tools_answer_a_call_or_text_and_take_a_tool_result(client):
    ask = [{"role": "user", "content": "What is the weather like in Paris? Use the tool."}]
    # 40 tokens hold a whole call; without a limit the model may write up to the default 1,024
    r = client.chat(model=MODEL, messages=ask, tools=[WEATHER_TOOL], options={"temperature": 0, "num_predict": 40})
    if r.message.tool_calls:  # the small model may or may not call; either way it is well formed
        [call] = r.message.tool_calls
        assert call.function.name == "get_weather" and isinstance(call.function.arguments["city"], str)
        history = ask + [
            r.message.model_dump(exclude_none=True),
            {"role": "tool", "content": "18 degrees, sunny", "tool_name": "get_weather"},
        ]
    else:
        assert r.message.content
        history = ask + [
            {
                "role": "assistant",
                "content": "",
                "tool_calls": [{"function": {"name": "get_weather", "arguments": {"city": "Paris"}}}],
            },
            {"role": "tool", "content": "18 degrees, sunny", "tool_name": "get_weather"},
        ]
    answer = client.chat(model=MODEL, messages=history, tools=[WEATHER_TOOL], options=GREEDY)
    assert answer.done and answer.prompt_eval_count > r.prompt_eval_count


def test_streamed_tools_come_whole_in_the_last_chunk(client):
    """With tools the text is held until the answer ends (a call cannot be told from text
    before then): the stream is one last chunk with the content or the calls, and the timings."""
    ask = [{"role": "user", "content": "What is the weather like in Paris? Use the tool."}]
    chunks = list(
        client.chat(
            model=MODEL, messages=ask, tools=[WEATHER_TOOL], stream=True, options={"temperature": 0, "num_predict": 40}
        )
    )
    *held, last = chunks
    assert last.done and all(not c.done and not c.message.content and not c.message.tool_calls for c in held)
    assert last.message.content or last.message.tool_calls
    for call in last.message.tool_calls or ():
        assert call.function.name == "get_weather" and isinstance(call.function.arguments, dict)
    _check_durations(last)


def test_pull_create_delete_are_answered_clearly(client, server):
    assert client.pull(MODEL).status == "success"  # already here: nothing to download
    with pytest.raises(ollama.ResponseError) as err:
        client.pull("llama3:8b")
    assert err.value.status_code == 404 and "never downloads" in err.value.error
    for call in (
        lambda: client.delete(MODEL),
        lambda: client.copy(MODEL, "other"),
        lambda: client.create(model="other", from_=MODEL),
    ):
        with pytest.raises(ollama.ResponseError) as err:
            call()
        assert err.value.status_code == 403 and "management API" in err.value.error
    assert server.post("inference", "/api/chat", json={"model": MODEL, "messages": ASK}, token=None).status == 401


@pytest.mark.parametrize(
    ("body", "status", "field"),
    [
        ({"model": "nosuchmodel", "messages": ASK}, 404, "nosuchmodel"),
        ({"model": MODEL, "messages": "hi"}, 400, "messages"),
        ({"model": MODEL, "messages": ASK, "options": {"temperature": "hot"}}, 400, "options.temperature"),
        ({"model": MODEL, "messages": ASK, "options": {"num_ctx": 100000}}, 400, "options.num_ctx"),
        ({"model": MODEL, "messages": ASK, "options": {"num_predict": 0}}, 400, "options.num_predict"),
        ({"model": MODEL, "messages": ASK, "stream": "yes"}, 400, "stream"),
        ({"model": MODEL, "messages": [{"role": "user", "content": "hi", "images": ["aGk="]}]}, 400, "images"),
        (
            {
                "model": MODEL,
                "messages": [
                    {"role": "user", "content": "hi", "tool_calls": [{"function": {"name": "f", "arguments": {}}}]}
                ],
            },
            400,
            "tool_calls",
        ),
        (
            {
                "model": MODEL,
                "messages": [
                    {"role": "assistant", "tool_calls": [{"function": {"name": "f", "arguments": "not json"}}]}
                ],
            },
            400,
            "arguments",
        ),
        ({"model": MODEL, "messages": ASK, "keep_alive": "soon"}, 400, "keep_alive"),
        ({"model": MODEL, "messages": ASK, "format": 7}, 400, "format"),
    ],
)
def test_bad_chat_bodies(server, body, status, field):
    r = server.post("inference", "/api/chat", json=body)
    assert r.status == status, r.text
    assert set(r.json()) == {"error"} and field in r.json()["error"]


def test_bad_bodies_on_the_other_routes(server):
    for path, body, field in (
        ("/api/generate", {"model": MODEL, "prompt": 5}, "prompt"),
        ("/api/embed", {"model": MODEL, "input": []}, "input"),
        ("/api/embeddings", {"model": MODEL, "prompt": ""}, "prompt"),
        ("/api/show", {}, "model"),
        ("/api/generate", {"prompt": "hi"}, "model"),
    ):
        r = server.post("inference", path, json=body)
        assert r.status == 400 and field in r.json()["error"], (path, r.text)
    r = server.request(
        "POST", "inference", "/api/chat", data=b"{not json", headers={"Content-Type": "application/json"}
    )
    assert r.status == 400 and "error" in r.json()
    r = server.get("inference", "/api/nosuchroute")
    assert r.status == 404 and set(r.json()) == {"error"}


# -- LangChain's ChatOllama ------------------------------------------------------------------


@pytest.fixture(scope="module")
def chat_ollama(server):
    langchain_ollama = pytest.importorskip("langchain_ollama")
    return langchain_ollama.ChatOllama(
        model=MODEL,
        base_url=server.url("inference"),
        temperature=0,
        num_predict=24,
        client_kwargs={"headers": {"Authorization": f"Bearer {server.keys['inference']}"}},
    )


def test_langchain_chat_ollama_invoke_and_stream(chat_ollama):
    message = chat_ollama.invoke("What is 2 plus 2?")
    assert "4" in message.content and message.usage_metadata["output_tokens"] > 0
    pieces = list(chat_ollama.stream("What is 2 plus 2?"))
    assert len(pieces) > 2 and "".join(p.content for p in pieces) == message.content


def test_langchain_chat_ollama_tools_and_structured_output(chat_ollama):
    message = chat_ollama.bind_tools([WEATHER_TOOL]).invoke("What is the weather like in Paris? Use the tool.")
    for call in message.tool_calls:  # a call or text: either way well formed
        assert call["name"] == "get_weather" and isinstance(call["args"]["city"], str)
    assert message.tool_calls or message.content
    city = chat_ollama.with_structured_output(City).invoke("Name a city in France.")
    assert isinstance(city, City) and city.name
