"""The OpenAI surface beyond chat and completions basics, through the official `openai` SDK
against a real server with the default model: client.models.retrieve, a list of prompts on
/v1/completions (OpenAI's choice numbering, whole and streamed), `echo`, `logit_bias`, and the
Responses API (create, stream, json_schema, function tools, what it refuses), and embeddings
(shape, norm, identical and different texts, batches, base64 and float, what it refuses). Every
error status through the SDK: test_openai_errors.py."""

from __future__ import annotations

import json

import pytest

from tests.server.conftest import MODEL
from tests.server.openai_fixtures import client, server  # noqa: F401 -- fixtures

openai = pytest.importorskip("openai")
pytestmark = pytest.mark.slow

# Greedy answers with wide margins in bf16 (every top-1 token >= 1.7 nats ahead): the test compares
# a batch's answers with single ones, and a batch may sum in another order. "Monday, Tuesday,"
# was here: its two best first tokens are 0.06 nats apart and tie in a batch of 4.
PROMPTS = ["1, 2, 3, 4,", "a, b, c, d,"]


def test_models_retrieve(client):
    model = client.models.retrieve(MODEL)
    assert model.id == MODEL and model.object == "model" and model.model_extra["version"] == "1.0"
    assert client.models.retrieve(f"{MODEL}@1.0").id == f"{MODEL}@1.0"
    with pytest.raises(openai.NotFoundError) as err:
        client.models.retrieve("nosuchmodel")
    assert "nosuchmodel" in err.value.message


def test_two_prompts_numbered_as_openai_does(client):
    singles = [
        client.completions.create(model=MODEL, prompt=p, max_tokens=6, temperature=0).choices[0].text for p in PROMPTS
    ]
    r = client.completions.create(model=MODEL, prompt=PROMPTS, max_tokens=6, temperature=0, n=2)
    assert sorted(c.index for c in r.choices) == [0, 1, 2, 3]
    by_index = {c.index: c.text for c in r.choices}
    # prompt i, choice j -> index i * n + j; greedy, so both choices of a prompt are its single answer
    assert [by_index[i] for i in range(4)] == [singles[0], singles[0], singles[1], singles[1]]
    assert r.usage.completion_tokens == 24
    streamed: dict[int, str] = {}
    finish: dict[int, str] = {}
    for chunk in client.completions.create(
        model=MODEL, prompt=PROMPTS, max_tokens=6, temperature=0, stream=True, stream_options={"include_usage": True}
    ):
        for c in chunk.choices:
            streamed[c.index] = streamed.get(c.index, "") + c.text
            if c.finish_reason:
                finish[c.index] = c.finish_reason
        if chunk.usage is not None:
            assert chunk.usage.completion_tokens == 12
    assert streamed == {0: singles[0], 1: singles[1]} and finish == {0: "length", 1: "length"}
    ids = client.completions.create(model=MODEL, prompt=[[16, 28, 17], [33]], max_tokens=2, temperature=0)
    assert sorted(c.index for c in ids.choices) == [0, 1]


def test_echo_whole_and_streamed(client):
    plain = client.completions.create(model=MODEL, prompt=PROMPTS[0], max_tokens=4, temperature=0).choices[0].text
    r = client.completions.create(model=MODEL, prompt=PROMPTS, max_tokens=4, temperature=0, echo=True)
    assert {c.index: c.text[: len(PROMPTS[c.index])] for c in r.choices} == {0: PROMPTS[0], 1: PROMPTS[1]}
    assert [c.text for c in r.choices if c.index == 0] == [PROMPTS[0] + plain]
    streamed = "".join(
        c.choices[0].text
        for c in client.completions.create(
            model=MODEL, prompt=PROMPTS[0], max_tokens=4, temperature=0, echo=True, stream=True
        )
        if c.choices
    )
    assert streamed == PROMPTS[0] + plain


def test_logit_bias_bans_and_forces_tokens(server, client):
    first = server.post(
        "inference", f"/predictions/{MODEL}", json={"prompt": PROMPTS[0], "max_tokens": 1, "temperature": 0}
    ).json()["choices"][0]
    greedy_id = first["token_ids"][0]
    banned = client.completions.create(
        model=MODEL, prompt=PROMPTS[0], max_tokens=1, temperature=0, logit_bias={str(greedy_id): -100}
    )
    assert banned.choices[0].text != first["text"]
    forced = server.post(
        "inference",
        f"/predictions/{MODEL}",
        json={"prompt": PROMPTS[0], "max_tokens": 3, "temperature": 0, "logit_bias": {"33": 100}},
    ).json()
    assert forced["choices"][0]["token_ids"] == [33, 33, 33]
    with pytest.raises(openai.BadRequestError) as err:
        client.completions.create(model=MODEL, prompt="x", max_tokens=1, logit_bias={"99999999": 1})
    assert "logit_bias" in err.value.message and "vocabulary" in err.value.message


# -- the Responses API ---------------------------------------------------------------------------


def test_responses_create_text_instructions_and_usage(client):
    chat = client.chat.completions.create(
        model=MODEL,
        max_tokens=12,
        temperature=0,
        messages=[{"role": "system", "content": "Answer briefly."}, {"role": "user", "content": "What is 2 plus 2?"}],
    )
    r = client.responses.create(
        model=MODEL, instructions="Answer briefly.", input="What is 2 plus 2?", max_output_tokens=12, temperature=0
    )
    assert r.object == "response" and r.id.startswith("resp_") and r.status in {"completed", "incomplete"}
    assert r.output_text == chat.choices[0].message.content  # the same request as a chat completion
    assert r.usage.input_tokens == chat.usage.prompt_tokens and r.usage.output_tokens == chat.usage.completion_tokens
    short = client.responses.create(
        model=MODEL,
        input=[{"role": "user", "content": [{"type": "input_text", "text": "Count: 1, 2, 3,"}]}],
        max_output_tokens=2,
        temperature=0,
    )
    assert short.status == "incomplete" and short.incomplete_details.reason == "max_output_tokens"


def test_responses_stream_events(client):
    whole = client.responses.create(model=MODEL, input="Name a fruit.", max_output_tokens=10, temperature=0)
    events = list(
        client.responses.create(model=MODEL, input="Name a fruit.", max_output_tokens=10, temperature=0, stream=True)
    )
    kinds = [e.type for e in events]
    assert kinds[:4] == [
        "response.created",
        "response.in_progress",
        "response.output_item.added",
        "response.content_part.added",
    ]
    final = events[-1].response
    assert kinds[-4:] == [
        "response.output_text.done",
        "response.content_part.done",
        "response.output_item.done",
        "response.completed" if final.status == "completed" else "response.incomplete",
    ]
    assert "".join(e.delta for e in events if e.type == "response.output_text.delta") == final.output_text
    assert final.output_text and final.usage.output_tokens <= 10
    assert whole.output_text  # (bf16 prefix-cache hits may change a late token, so no cross-check)
    assert [e.sequence_number for e in events] == list(range(len(events)))


def test_responses_json_schema_and_function_tools(client):
    schema = {
        "type": "object",
        "properties": {"fruit": {"type": "string"}},
        "required": ["fruit"],
        "additionalProperties": False,
    }
    r = client.responses.create(
        model=MODEL,
        input="Name a fruit as JSON.",
        max_output_tokens=30,
        temperature=0,
        text={"format": {"type": "json_schema", "name": "fruit", "schema": schema}},
    )
    assert isinstance(json.loads(r.output_text)["fruit"], str)
    tool = {
        "type": "function",
        "name": "get_weather",
        "description": "Weather in a city",
        "parameters": {
            "type": "object",
            "properties": {"city": {"type": "string"}},
            "required": ["city"],
            "additionalProperties": False,
        },
    }
    r = client.responses.create(
        model=MODEL,
        input="Weather in Paris?",
        tools=[tool],
        tool_choice="required",
        max_output_tokens=40,
        temperature=0,
    )
    [call] = [item for item in r.output if item.type == "function_call"]
    assert call.name == "get_weather" and isinstance(json.loads(call.arguments)["city"], str)
    events = list(
        client.responses.create(
            model=MODEL,
            input="Weather in Paris?",
            tools=[tool],
            tool_choice="required",
            max_output_tokens=40,
            temperature=0,
            stream=True,
        )
    )
    done = [e for e in events if e.type == "response.function_call_arguments.done"]
    assert [e.arguments for e in done] == [call.arguments]
    follow = client.responses.create(
        model=MODEL,
        max_output_tokens=20,
        temperature=0,
        tools=[tool],
        input=[
            {"role": "user", "content": "Weather in Paris?"},
            {"type": "function_call", "call_id": call.call_id, "name": call.name, "arguments": call.arguments},
            {"type": "function_call_output", "call_id": call.call_id, "output": "18 C, sunny"},
        ],
        tool_choice="none",
    )
    assert follow.output_text


@pytest.mark.parametrize(
    "extra, param",
    [
        ({"previous_response_id": "resp_1"}, "previous_response_id"),
        ({"store": True}, "store"),
        ({"input": [{"type": "web_search_call"}]}, "input[0].type"),
        ({"tools": [{"type": "web_search"}]}, "tools"),
    ],
)
def test_responses_refusals(client, extra, param):
    with pytest.raises(openai.BadRequestError) as err:
        client.responses.create(**{"model": MODEL, "input": "hi", **extra})
    assert param.split("[")[0] in err.value.message


# -- embeddings ----------------------------------------------------------------------------------


def test_embeddings_through_the_sdk(server, client):
    np = pytest.importorskip("numpy")
    texts = ["The cat sat on the mat.", "Stock markets fell sharply today.", "The cat sat on the mat."]
    r = client.embeddings.create(model=MODEL, input=texts)  # the SDK asks for base64 and decodes it
    assert r.object == "list" and r.model == MODEL and [d.index for d in r.data] == [0, 1, 2]
    vectors = np.array([d.embedding for d in r.data])
    assert vectors.shape == (3, 576)  # SmolLM2's hidden size
    assert r.model_extra["timings"]["total_s"] > 0 and "cached_prompt_tokens" in r.model_extra["timings"]
    assert np.allclose(np.linalg.norm(vectors, axis=1), 1.0, atol=1e-4)
    # Identical text, identical vector (up to bf16 rounding: the repeat may hit the prefix cache);
    # different texts differ.
    assert vectors[0] @ vectors[2] > 0.999 and vectors[0] @ vectors[1] < 0.99
    first = client.embeddings.create(model=MODEL, input=texts[0], encoding_format="float")
    single = client.embeddings.create(model=MODEL, input=texts[1], encoding_format="float")
    # float and base64 carry the same vector; alone or in a batch, the text gets the same direction
    # (in bf16 a batch of other rows may sum in another order: not bit-identical).
    single_b64 = client.embeddings.create(model=MODEL, input=texts[1]).data[0].embedding
    assert np.allclose(single.data[0].embedding, single_b64, atol=1e-6)
    assert np.array(single_b64) @ vectors[1] > 0.999
    assert single.usage.prompt_tokens == single.usage.total_tokens > 0
    assert r.usage.prompt_tokens == 2 * first.usage.prompt_tokens + single.usage.prompt_tokens
    token_ids = server.post("inference", f"/predictions/{MODEL}", json={"prompt": texts[1], "max_tokens": 1}).json()
    by_ids = client.embeddings.create(model=MODEL, input=[token_ids["choices"][0]["token_ids"], [16, 28, 17]])
    assert len(by_ids.data) == 2 and all(len(d.embedding) == 576 for d in by_ids.data)
    prefixed = openai.OpenAI(
        base_url=server.url("inference", f"/predictions/{MODEL}/1.0/v1"),
        api_key=server.keys["inference"],
        max_retries=0,
    )
    assert np.allclose(
        prefixed.embeddings.create(model="ignored", input=texts[1]).data[0].embedding, single_b64, atol=1e-6
    )


@pytest.mark.parametrize(
    "extra, param",
    [
        ({"dimensions": 64}, "dimensions"),
        ({"input": ""}, "input"),
        ({"input": ["ok", []]}, "input"),
        ({"encoding_format": "int8"}, "encoding_format"),
    ],
)
def test_embeddings_refusals(client, extra, param):
    with pytest.raises(openai.BadRequestError) as err:
        client.embeddings.create(**{"model": MODEL, "input": "hi", **extra})
    assert err.value.body["param"] == param and param in err.value.message
