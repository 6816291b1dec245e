"""vLLM's extra routes and request fields on the session's shared real server with the default
model: /tokenize (a prompt, chat messages) and /detokenize round trip, /version, /health, and
`priority` + `cache_salt` on completions, chat and the Responses API: two tenants sending the same
prompt get no prefix-cache hit from each other, the same tenant does (the per-request hit
counter `cached_tokens`). Bad bodies: OpenAI's error shape, 400 naming the field."""

from __future__ import annotations

import uuid

import pytest

from tests.server.conftest import MODEL
from tests.server.openai_fixtures import client, server  # noqa: F401 -- fixtures

openai = pytest.importorskip("openai")
pytestmark = pytest.mark.slow


def test_tokenize_and_detokenize(server):
    r = server.post("inference", "/tokenize", json={"model": MODEL, "prompt": "Hello world, hello pagedserve."})
    assert r.status == 200, r.text
    body = r.json()
    assert body["count"] == len(body["tokens"]) > 3 and body["max_model_len"] == 2048
    back = server.post("inference", "/detokenize", json={"model": MODEL, "tokens": body["tokens"]}).json()
    assert back["prompt"] == "Hello world, hello pagedserve."
    chat = server.post(
        "inference",
        "/tokenize",
        json={"model": MODEL, "messages": [{"role": "user", "content": "Hello world, hello pagedserve."}]},
    ).json()
    assert chat["count"] > body["count"] + 3  # the chat template's tokens around the text


def test_version_and_health(server):
    assert server.get("inference", "/version").json()["version"]
    r = server.get("inference", "/health", token=None)  # public, like the other probes
    assert r.status == 200 and r.body == b""


@pytest.mark.parametrize(
    ("path", "body", "field"),
    [
        ("/tokenize", {"model": MODEL}, "prompt"),
        ("/tokenize", {"model": MODEL, "prompt": 5}, "prompt"),
        ("/tokenize", {"model": "nosuchmodel", "prompt": "x"}, "model"),
        ("/detokenize", {"model": MODEL, "tokens": [1, "a"]}, "tokens"),
        ("/detokenize", {"model": MODEL, "tokens": [10_000_000]}, "tokens"),
        ("/v1/completions", {"model": MODEL, "prompt": "x", "priority": "high"}, "priority"),
        (
            "/v1/chat/completions",
            {"model": MODEL, "messages": [{"role": "user", "content": "x"}], "cache_salt": 5},
            "cache_salt",
        ),
        ("/v1/responses", {"model": MODEL, "input": "x", "cache_salt": ""}, "cache_salt"),
    ],
)
def test_bad_bodies(server, path, body, field):
    r = server.post("inference", path, json=body)
    assert 400 <= r.status < 500, r.text
    error = r.json()["error"]
    assert set(error) == {"message", "type", "param", "code"} and field in (error["param"] or "") + error["message"]


def test_cache_salt_isolates_tenants_prefix_cache_hits(client):
    """A prompt of several full blocks (16 tokens each), unique to this test run."""
    prompt = f"Run {uuid.uuid4().hex}. " + "The quick brown fox jumps over the lazy dog. " * 8

    def cached(salt: str | None, route: str = "completions") -> int:
        extra = {"cache_salt": salt} if salt else {}
        if route == "completions":
            r = client.completions.create(model=MODEL, prompt=prompt, max_tokens=1, extra_body={**extra, "priority": 1})
            return r.usage.prompt_tokens_details.cached_tokens
        if route == "chat":
            r = client.chat.completions.create(
                model=MODEL, messages=[{"role": "user", "content": prompt}], max_tokens=1, extra_body=extra
            )
            return r.usage.prompt_tokens_details.cached_tokens
        r = client.responses.create(model=MODEL, input=prompt, max_output_tokens=1, extra_body=extra)
        return r.usage.input_tokens_details.cached_tokens

    assert cached("tenant-a") == 0
    assert cached("tenant-b") == 0  # the same prompt, another tenant: no hit
    assert cached(None) == 0  # nor for requests with no salt
    assert cached("tenant-a") >= 64  # the same tenant hits its own blocks
    assert cached(None) >= 64
    assert cached("tenant-c", "chat") == 0 and cached("tenant-c", "chat") >= 64
    assert cached("tenant-d", "responses") == 0 and cached("tenant-d", "responses") >= 64
    assert cached("tenant-c", "responses") >= 64  # chat and Responses render the same prompt
