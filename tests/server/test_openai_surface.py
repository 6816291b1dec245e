"""The OpenAI surface beyond chat and completions basics, through the official `openai` SDK
against a real server with the default model: client.models.retrieve, a list of prompts on
/v1/completions (OpenAI's choice numbering, whole and streamed), `echo`, and `logit_bias`."""

from __future__ import annotations

import pytest

from tests.server.conftest import ARCHIVE, MODEL

openai = pytest.importorskip("openai")
pytestmark = pytest.mark.slow

PROMPTS = ["1, 2, 3, 4,", "Monday, Tuesday,"]


@pytest.fixture(scope="module")
def server(module_server_factory):
    return module_server_factory(models=[f"{MODEL}={ARCHIVE}"])


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=server.url("inference", "/v1"), api_key=server.keys["inference"],
                         max_retries=0, timeout=120)


def test_models_retrieve(client):
    model = client.models.retrieve(MODEL)
    assert model.id == MODEL and model.object == "model" and model.model_extra["version"] == "1.0"
    assert client.models.retrieve(f"{MODEL}@1.0").id == f"{MODEL}@1.0"
    with pytest.raises(openai.NotFoundError) as err:
        client.models.retrieve("nosuchmodel")
    assert "nosuchmodel" in err.value.message


def test_two_prompts_numbered_as_openai_does(client):
    singles = [client.completions.create(model=MODEL, prompt=p, max_tokens=6, temperature=0).choices[0].text
               for p in PROMPTS]
    r = client.completions.create(model=MODEL, prompt=PROMPTS, max_tokens=6, temperature=0, n=2)
    assert sorted(c.index for c in r.choices) == [0, 1, 2, 3]
    by_index = {c.index: c.text for c in r.choices}
    # prompt i, choice j -> index i * n + j; greedy, so both choices of a prompt are its single answer
    assert [by_index[i] for i in range(4)] == [singles[0], singles[0], singles[1], singles[1]]
    assert r.usage.completion_tokens == 24
    streamed: dict[int, str] = {}
    finish: dict[int, str] = {}
    for chunk in client.completions.create(model=MODEL, prompt=PROMPTS, max_tokens=6, temperature=0, stream=True,
                                           stream_options={"include_usage": True}):
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
    assert {c.index: c.text[:len(PROMPTS[c.index])] for c in r.choices} == {0: PROMPTS[0], 1: PROMPTS[1]}
    assert [c.text for c in r.choices if c.index == 0] == [PROMPTS[0] + plain]
    streamed = "".join(c.choices[0].text for c in client.completions.create(
        model=MODEL, prompt=PROMPTS[0], max_tokens=4, temperature=0, echo=True, stream=True) if c.choices)
    assert streamed == PROMPTS[0] + plain


def test_logit_bias_bans_and_forces_tokens(server, client):
    first = server.post("inference", f"/predictions/{MODEL}",
                        json={"prompt": PROMPTS[0], "max_tokens": 1, "temperature": 0}).json()["choices"][0]
    greedy_id = first["token_ids"][0]
    banned = client.completions.create(model=MODEL, prompt=PROMPTS[0], max_tokens=1, temperature=0,
                                       logit_bias={str(greedy_id): -100})
    assert banned.choices[0].text != first["text"]
    forced = server.post("inference", f"/predictions/{MODEL}", json={
        "prompt": PROMPTS[0], "max_tokens": 3, "temperature": 0, "logit_bias": {"33": 100}}).json()
    assert forced["choices"][0]["token_ids"] == [33, 33, 33]
    with pytest.raises(openai.BadRequestError) as err:
        client.completions.create(model=MODEL, prompt="x", max_tokens=1, logit_bias={"99999999": 1})
    assert "logit_bias" in err.value.message and "vocabulary" in err.value.message
