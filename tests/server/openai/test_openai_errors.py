"""Every error status of /v1/* in OpenAI's shape, parsed by the official `openai` SDK into its
matching exception class (max_retries=0): 400, 401, 404 (a model, a route), 405, 413, 429,
503 (a full queue, a draining server) and 504 (responseTimeout), each produced for real.

In-process, on the tiny model, configured small: jobQueueSize 1 and a request body limit of
64 KiB; version 2.0 is registered with response_timeout=3. A worker stopped with SIGSTOP stands
for an engine that gives no output (no guess about how fast a machine generates); the grammar
checks' per-client share is set to 0 for the 429 (the real limiter, configured small)."""

from __future__ import annotations

import os
import signal
import threading

import pytest

from tests.server import observe
from tests.server.conftest import TINY as MODEL
from tests.server.conftest import TINY_ARCHIVE as ARCHIVE
from tests.server.conftest import TINY_ARCHIVE_V2

openai = pytest.importorskip("openai")

QUICK = "2.0"  # the version with response_timeout=3
MAX_REQUEST = 64 * 1024
ASK = [{"role": "user", "content": "hi"}]


@pytest.fixture(scope="module")
def server(inprocess_factory):
    server = inprocess_factory(
        load_models=[f"{MODEL}={ARCHIVE}"], enable_model_api=True, job_queue_size=1, max_request_size=MAX_REQUEST
    )
    r = server.post("management", f"/models?url={TINY_ARCHIVE_V2}&response_timeout=3&synchronous=true")
    assert r.status == 200, r.text
    return server


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(
        base_url=server.url("inference", "/v1"), api_key=server.keys["inference"], max_retries=0, timeout=120
    )


def error_of(exc: openai.APIStatusError, status: int, kind: str) -> dict:
    """The OpenAI-shaped error body the SDK parsed (`exc.body` is the inner `error` object)."""
    assert exc.status_code == status and exc.response.headers["x-request-id"]
    body = exc.response.json()
    assert set(body) == {"error"} and set(body["error"]) == {"message", "type", "param", "code"}
    assert exc.body == body["error"] and exc.body["type"] == kind and exc.message
    return exc.body


def test_400_401_404_405_413(server, client):
    with pytest.raises(openai.BadRequestError) as err:
        client.chat.completions.create(model=MODEL, messages=ASK, max_tokens=0)
    assert error_of(err.value, 400, "invalid_request_error")["param"] == "max_tokens"
    bad_key = openai.OpenAI(base_url=server.url("inference", "/v1"), api_key="wrong", max_retries=0)
    with pytest.raises(openai.AuthenticationError) as err:
        bad_key.chat.completions.create(model=MODEL, messages=ASK)
    assert error_of(err.value, 401, "authentication_error")["code"] == 401
    with pytest.raises(openai.NotFoundError) as err:
        client.embeddings.create(model="nosuch", input="x")
    assert error_of(err.value, 404, "invalid_request_error")["code"] == "model_not_found"
    with pytest.raises(openai.NotFoundError) as err:
        client.get("/nosuchroute", cast_to=object)
    assert error_of(err.value, 404, "invalid_request_error")["code"] == "unknown_url"
    with pytest.raises(openai.APIStatusError) as err:  # the SDK has no class of its own for 405
        client.get("/chat/completions", cast_to=object)
    assert type(err.value) is openai.APIStatusError
    assert error_of(err.value, 405, "invalid_request_error")["code"] == 405
    with pytest.raises(openai.APIStatusError) as err:  # nor for 413
        client.completions.create(model=MODEL, prompt="x" * MAX_REQUEST, max_tokens=1)
    assert type(err.value) is openai.APIStatusError
    assert "max_request_size" in error_of(err.value, 413, "invalid_request_error")["message"]


def test_429_when_a_client_exceeds_its_share_of_grammar_checks(server, client):
    grammar = server.state.limits.grammar
    share = grammar.per_client_admitted
    grammar.per_client_admitted = 0
    try:
        with pytest.raises(openai.RateLimitError) as err:
            client.chat.completions.create(
                model=MODEL, messages=ASK, max_tokens=4, response_format={"type": "json_object"}
            )
    finally:
        grammar.per_client_admitted = share
    assert error_of(err.value, 429, "rate_limit_error")["code"] == 429
    assert err.value.response.headers["Retry-After"]


def test_503_when_the_queue_is_full(server, client):
    pid = observe.worker(server, MODEL, "1.0")["pid"]
    version = server.state.registry.resolve(MODEL, "1.0")
    answers = []
    first = threading.Thread(
        target=lambda: answers.append(client.completions.create(model=f"{MODEL}@1.0", prompt="x", max_tokens=2))
    )
    os.kill(pid, signal.SIGSTOP)  # the first request stays in flight (jobQueueSize 1)
    try:
        first.start()
        server.wait_for(lambda: version.in_flight == 1, timeout=60, what="the first request in flight")
        with pytest.raises(openai.InternalServerError) as err:
            client.completions.create(model=f"{MODEL}@1.0", prompt="x", max_tokens=2)
    finally:
        os.kill(pid, signal.SIGCONT)
    first.join(120)
    assert error_of(err.value, 503, "service_unavailable")["code"] == 503
    assert "jobQueueSize" in err.value.message and err.value.response.headers["Retry-After"]
    assert answers and answers[0].choices  # the first one is answered once the worker runs again


def test_504_when_the_reply_takes_longer_than_the_response_timeout(server, client):
    pid = observe.worker(server, MODEL, QUICK)["pid"]
    os.kill(pid, signal.SIGSTOP)  # the engine gives no output at all
    try:
        with pytest.raises(openai.InternalServerError) as err:  # the SDK maps every 5xx to it
            client.chat.completions.create(model=f"{MODEL}@{QUICK}", messages=ASK, max_tokens=4)
    finally:
        os.kill(pid, signal.SIGCONT)
    assert "responseTimeout" in error_of(err.value, 504, "server_error")["message"]
    server.wait_for(lambda: observe.all_blocks_free(server, MODEL, QUICK), timeout=30, what="the request aborted")


def test_503_while_draining(inprocess_factory):
    draining = inprocess_factory()  # no model: nothing to start
    draining.loop.call_soon_threadsafe(draining.state.drain.begin)
    draining.wait_for(lambda: draining.state.draining, timeout=10, what="draining")
    client = openai.OpenAI(base_url=draining.url("inference", "/v1"), api_key=draining.keys["inference"], max_retries=0)
    with pytest.raises(openai.InternalServerError) as err:
        client.models.list()
    assert "shutting down" in error_of(err.value, 503, "service_unavailable")["message"]
