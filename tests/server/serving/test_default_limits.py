"""Requests that name no token limit (issue 29): they get the model's `defaultMaxTokens`
(model-config; 1024 unless set), capped by the context the prompt leaves, and the client gets
the whole answer, never a 504. On the session's shared real server with the default model
(chat and the Responses API through the OpenAI SDK, which waits for the answer) and on an
in-process server over the tiny random-weight model (which never ends by itself) whose
model-config sets defaultMaxTokens: 40."""

from __future__ import annotations

import pytest

from tests.server.conftest import MODEL, TINY
from tests.server.openai_fixtures import client, server  # noqa: F401 -- fixtures

openai = pytest.importorskip("openai")


def test_chat_and_responses_without_a_limit_answer_whole(client, server):
    chat = client.chat.completions.create(
        model=MODEL, temperature=0, messages=[{"role": "user", "content": "What is 2 plus 2?"}]
    )
    assert chat.choices[0].finish_reason == "stop" and "4" in chat.choices[0].message.content
    r = client.responses.create(model=MODEL, input="Write two sentences about the sea.", temperature=0)
    assert r.status == "completed" and r.output_text and r.usage.output_tokens <= 1024
    [desc] = server.get("management", f"/models/{MODEL}").json()
    assert desc["defaultMaxTokens"] == 1024


CONFIG = """\
minWorkers: 1
maxWorkers: 1
startupTimeout: 300
defaultMaxTokens: 40
handler:
  dtype: float32
  max_model_len: 256
  kv_cache_memory: 8MiB
"""


@pytest.fixture(scope="module")
def tiny40(inprocess_factory, tiny_model, tmp_path_factory):
    """An in-process server over the tiny model with defaultMaxTokens: 40."""
    from pagedserve.engine.model.archive import write_archive

    store = tmp_path_factory.mktemp("limits_store")
    config = tmp_path_factory.mktemp("limits-config") / "model-config.yaml"
    config.write_text(CONFIG)
    write_archive(tiny_model, store, model_name=TINY, version="1.0", config_file=config)
    return inprocess_factory(model_store=str(store), load_models=[f"{TINY}={TINY}.mar"])


def test_the_model_configs_default_and_the_context_left(tiny40):
    """The tiny model never ends by itself: a request without a limit stops at the model's
    defaultMaxTokens, or at the end of the context when less is left."""
    openai_client = openai.OpenAI(
        base_url=tiny40.url("inference", "/v1"), api_key=tiny40.keys["inference"], max_retries=0, timeout=300
    )
    chat = openai_client.chat.completions.create(
        model=TINY, temperature=0, messages=[{"role": "user", "content": "Tell me a long story."}]
    )
    assert chat.choices[0].finish_reason == "length" and chat.usage.completion_tokens == 40
    r = openai_client.responses.create(model=TINY, input="Tell me a long story.", temperature=0)
    assert r.status == "incomplete" and r.usage.output_tokens == 40
    long_prompt = [{"role": "user", "content": " ".join(["word"] * 225)}]
    near_the_end = openai_client.chat.completions.create(model=TINY, messages=long_prompt, temperature=0)
    assert near_the_end.usage.completion_tokens < 40
    assert near_the_end.usage.prompt_tokens + near_the_end.usage.completion_tokens == 256
    shown = tiny40.post("inference", "/api/show", json={"model": TINY}).json()
    assert "default_max_tokens 40" in shown["parameters"]
