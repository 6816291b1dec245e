"""The official `openai` Python package against a real server: chat, completions, streaming
(with usage), `n`, `stop`, `logprobs`, seed reproducibility, model@version and the
/predictions/{model}/{version}/v1 prefix, and the SDK's error classes for 400/401/404."""

from __future__ import annotations

import json
import re

import pytest

from tests.server.conftest import MODEL
from tests.server.openai_fixtures import client, server  # noqa: F401 -- fixtures

openai = pytest.importorskip("openai")
pytestmark = pytest.mark.slow

PROMPT = "1, 2, 3, 4,"
QUESTION = [{"role": "user", "content": "What is 2 plus 2?"}]


def test_chat(client):
    r = client.chat.completions.create(model=MODEL, messages=QUESTION, max_tokens=30, temperature=0)
    [choice] = r.choices
    assert r.object == "chat.completion" and r.id.startswith("chatcmpl-") and r.model == MODEL
    assert choice.message.role == "assistant" and "4" in choice.message.content
    assert choice.finish_reason == "stop"
    assert r.usage.prompt_tokens > 0 and r.usage.total_tokens == r.usage.prompt_tokens + r.usage.completion_tokens
    assert r.model_extra["timings"]["ttft_s"] > 0


def test_completion_and_its_stream_agree(client):
    r = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=8, temperature=0)
    [choice] = r.choices
    assert r.object == "text_completion" and choice.text.startswith(" 5, 6, 7") and choice.finish_reason == "length"
    assert r.usage.completion_tokens == 8
    chunks = list(
        client.completions.create(
            model=MODEL, prompt=PROMPT, max_tokens=8, temperature=0, stream=True, stream_options={"include_usage": True}
        )
    )
    assert len(chunks) > 2
    assert "".join(c.choices[0].text for c in chunks if c.choices) == choice.text
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "length"
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == 8
    assert chunks[-1].model_extra["timings"]["ttft_s"] > 0


def test_chat_stream(client):
    whole = client.chat.completions.create(model=MODEL, messages=QUESTION, max_tokens=20, temperature=0)
    chunks = list(
        client.chat.completions.create(model=MODEL, messages=QUESTION, max_tokens=20, temperature=0, stream=True)
    )
    assert chunks[0].choices[0].delta.role == "assistant"
    assert "".join(c.choices[0].delta.content or "" for c in chunks) == whole.choices[0].message.content
    assert chunks[-1].choices[0].finish_reason == whole.choices[0].finish_reason
    assert chunks[-1].model_extra["timings"]["decode_s"] >= 0 and chunks[0].object == "chat.completion.chunk"


def test_n_and_seed(client):
    r = client.completions.create(model=MODEL, prompt="Once upon a time", max_tokens=8, n=3, seed=11, temperature=1)
    assert sorted(c.index for c in r.choices) == [0, 1, 2]
    assert 3 <= r.usage.completion_tokens <= 24
    again = client.completions.create(model=MODEL, prompt="Once upon a time", max_tokens=8, n=3, seed=11, temperature=1)
    assert [c.text for c in again.choices] == [c.text for c in r.choices]  # same seed, same samples
    others = {
        client.completions.create(model=MODEL, prompt="Once upon a time", max_tokens=8, seed=s, temperature=1)
        .choices[0]
        .text
        for s in (1, 2, 3)
    }
    assert len(others | {r.choices[0].text}) > 1  # different seeds, different samples
    chat = [
        client.chat.completions.create(model=MODEL, messages=QUESTION, max_tokens=8, seed=5, temperature=1, n=2)
        for _ in range(2)
    ]
    assert [c.message.content for c in chat[0].choices] == [c.message.content for c in chat[1].choices]


def test_stop(client):
    r = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=12, temperature=0, stop=[" 7", "zzz"])
    assert r.choices[0].text == " 5, 6," and r.choices[0].finish_reason == "stop"
    streamed = "".join(
        c.choices[0].text
        for c in client.completions.create(
            model=MODEL, prompt=PROMPT, max_tokens=12, temperature=0, stop=" 7", stream=True
        )
        if c.choices
    )
    assert streamed == " 5, 6,"  # the held-back start of the stop string never reached the client
    chat = client.chat.completions.create(model=MODEL, messages=QUESTION, max_tokens=30, temperature=0, stop=["4"])
    assert "4" not in chat.choices[0].message.content and chat.choices[0].finish_reason == "stop"


def test_logprobs(client):
    r = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=4, temperature=0, logprobs=3)
    lp = r.choices[0].logprobs
    assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) == 4
    assert "".join(lp.tokens) == r.choices[0].text and lp.text_offset[0] == 0
    for _token, logprob, top in zip(lp.tokens, lp.token_logprobs, lp.top_logprobs):
        assert logprob <= 0 and len(top) == 3
        assert max(top.values()) == pytest.approx(logprob)  # greedy: the sampled token is the top one
    chat = client.chat.completions.create(
        model=MODEL, messages=QUESTION, max_tokens=5, temperature=0, logprobs=True, top_logprobs=2
    )
    content = chat.choices[0].logprobs.content
    assert len(content) == chat.usage.completion_tokens
    assert "".join(t.token for t in content) == chat.choices[0].message.content
    assert all(len(t.top_logprobs) == 2 and t.top_logprobs[0].logprob == pytest.approx(t.logprob) for t in content)
    assert client.chat.completions.create(model=MODEL, messages=QUESTION, max_tokens=2).choices[0].logprobs is None


def test_versions_models_and_errors(server, client):
    assert [m.id for m in client.models.list()] == [MODEL, f"{MODEL}@1.0"]
    r = client.completions.create(model=f"{MODEL}@1.0", prompt=PROMPT, max_tokens=4, temperature=0)
    assert r.choices[0].text == " 5, " and r.model == f"{MODEL}@1.0"
    prefixed = openai.OpenAI(
        base_url=server.url("inference", f"/predictions/{MODEL}/1.0/v1"),
        api_key=server.keys["inference"],
        max_retries=0,
    )
    assert (
        prefixed.completions.create(model="ignored", prompt=PROMPT, max_tokens=4, temperature=0).choices[0].text
        == r.choices[0].text
    )
    with pytest.raises(openai.NotFoundError) as err:
        client.completions.create(model="nosuchmodel", prompt="x")
    assert "nosuchmodel" in err.value.message
    with pytest.raises(openai.BadRequestError) as err:
        client.completions.create(model=MODEL, prompt="x", max_tokens=5000)
    assert "max_tokens" in err.value.message
    with pytest.raises(openai.BadRequestError):
        client.chat.completions.create(model=MODEL, messages=QUESTION, temperature=-1)
    bad_key = openai.OpenAI(base_url=server.url("inference", "/v1"), api_key="wrong", max_retries=0)
    with pytest.raises(openai.AuthenticationError):
        bad_key.models.list()


def test_structured_output(server, client):
    pydantic = pytest.importorskip("pydantic")

    class Person(pydantic.BaseModel):
        name: str
        age: int

    ask = [{"role": "user", "content": "Describe a person named Ann who is 31 years old."}]
    r = client.chat.completions.parse(model=MODEL, messages=ask, response_format=Person, max_tokens=40, temperature=0)
    person = r.choices[0].message.parsed  # the SDK parsed the reply with the model class
    assert isinstance(person, Person) and person.name and r.choices[0].finish_reason == "stop"
    streamed = "".join(
        c.choices[0].delta.content or ""
        for c in client.chat.completions.create(
            model=MODEL,
            messages=ask,
            max_tokens=40,
            temperature=0,
            stream=True,
            response_format={
                "type": "json_schema",
                "json_schema": {"name": "person", "schema": Person.model_json_schema()},
            },
        )
    )
    assert Person.model_validate_json(streamed)
    any_json = client.chat.completions.create(
        model=MODEL, messages=ask, max_tokens=40, temperature=0, response_format={"type": "json_object"}
    )
    assert isinstance(json.loads(any_json.choices[0].message.content), dict)
    choice = client.completions.create(
        model=MODEL,
        prompt="Is Paris in France? Answer:",
        max_tokens=5,
        temperature=0,
        extra_body={"guided_choice": [" yes", " no"]},
    )
    assert choice.choices[0].text in {" yes", " no"}
    with pytest.raises(openai.BadRequestError) as err:
        client.chat.completions.create(model=MODEL, messages=ask, extra_body={"guided_regex": "a(b"})
    assert "invalid regex constraint" in err.value.message
    # /predictions takes the SamplingParams field, as every other sampling field.
    reply = server.post(
        "inference",
        f"/predictions/{MODEL}",
        json={
            "prompt": "My phone number is",
            "max_tokens": 12,
            "temperature": 0,
            "structured_outputs": {"regex": " [0-9]{3}-[0-9]{4}"},
        },
    )
    assert reply.status == 200, reply.text
    assert re.fullmatch(" [0-9]{3}-[0-9]{4}", reply.json()["choices"][0]["text"])
    bad = server.post("inference", f"/predictions/{MODEL}", json={"prompt": "x", "structured_outputs": {"json": 3}})
    assert bad.status == 400 and "structured_outputs.json" in bad.json()["message"]
