"""The front end's own behaviour, in-process (pagedserve.server.app.serve.Server on a loop of its own, real
HTTP on loopback, real engine workers on the tiny random-weight model): errors shaped by route
(OpenAI on /v1/*, TorchServe elsewhere) for every status the middlewares make, the drain (503
shaped by route, waited on until the last request ends), the lifecycle stopping the workers,
a stream that fails after its headers went out, bodies that lie about their Content-Encoding,
/ping with a version scaled to 0 workers, and the refusal to run without auth on a non-loopback
address."""

from __future__ import annotations

import gzip
import http.client
import json
import os
import signal
import subprocess
import sys
import zlib

import pytest

from pagedserve.server.app.serve import Server
from pagedserve.server.app.startup import check_secure
from pagedserve.server.common.config import ServerConfig, ServerConfigError
from pagedserve.server.serving.shapers import OpenAIShaper, PredictionShaper
from tests.server.conftest import TINY, TINY_ARCHIVE
from tests.server.server_process import REPO

MAX_REQUEST = 50_000
OPENAI_PATHS = ["/v1/completions", "/v1/chat/completions", f"/predictions/{TINY}/1.0/v1/completions"]


@pytest.fixture(scope="module")
def server(inprocess_factory):
    return inprocess_factory(
        load_models=[f"{TINY}={TINY_ARCHIVE}"], max_request_size=MAX_REQUEST, enable_model_api=True
    )


def openai_error(r, code: int) -> dict:
    assert r.status == code, r.text
    error = r.json()["error"]
    assert set(error) == {"message", "type", "param", "code"} and error["message"], error
    assert r.headers["x-request-id"]
    return error


def torchserve_error(r, code: int) -> dict:
    assert r.status == code, r.text
    body = r.json()
    assert body["code"] == code and body["type"] and body["message"], body
    return body


@pytest.mark.parametrize("path", OPENAI_PATHS)
def test_openai_routes_answer_every_error_in_openai_shape(server, path):
    body = {"model": TINY, "max_tokens": 1}
    body.update({"messages": [{"role": "user", "content": "x"}]} if "chat" in path else {"prompt": "x"})
    assert openai_error(server.post("inference", path, json=body, token=None), 401)["type"] == "authentication_error"
    assert openai_error(server.post("inference", path, json=body, token="wrong"), 401)
    assert openai_error(server.request("GET", "inference", path), 405)
    big = json.dumps({**body, "padding": "x" * MAX_REQUEST}).encode()
    assert "max_request_size" in openai_error(server.post("inference", path, data=big), 413)["message"]
    if not path.startswith("/predictions"):
        error = openai_error(server.post("inference", path, json={**body, "model": "nosuch"}), 404)
        assert "nosuch" in error["message"] and error["param"] == "model"
    assert server.post("inference", path, json=body).status == 200


def test_unknown_paths_are_shaped_by_where_they_point(server):
    error = openai_error(server.get("inference", "/v1/nothing"), 404)
    assert "/v1/nothing" in error["message"]
    assert "/nothing" in torchserve_error(server.get("inference", "/nothing"), 404)["message"]
    assert torchserve_error(server.get("management", "/nothing"), 404)["type"] == "ResourceNotFoundException"
    torchserve_error(server.post("inference", f"/predictions/{TINY}", json={"prompt": "x"}, token=None), 401)
    torchserve_error(server.request("DELETE", "inference", f"/predictions/{TINY}"), 405)
    torchserve_error(server.get("management", "/models", token=None), 401)


def test_a_version_with_no_worker_by_design_keeps_ping_healthy(server):
    """A version registered with no worker (minWorkers 0: loaded on demand) is no failure."""
    r = server.post("management", f"/models?url={TINY_ARCHIVE}&model_name=idle&initial_workers=0")
    assert r.status == 200, r.text
    try:
        assert server.get("inference", "/ping").json() == {"status": "Healthy"}
        assert server.get("inference", "/ready").status == 200
        assert server.predict("idle").status == 200  # the request loads a worker (on demand)
        assert server.get("inference", "/ping").json() == {"status": "Healthy"}
    finally:
        assert server.delete("management", "/models/idle").status == 200


# -- Content-Encoding (finding 5) --------------------------------------------------------------


@pytest.mark.parametrize("encoding", ["gzip", "deflate"])
@pytest.mark.parametrize("path", [f"/predictions/{TINY}", "/v1/completions"])
def test_a_body_that_is_not_its_content_encoding_is_a_400(server, encoding, path):
    r = server.post(
        "inference",
        path,
        data=b'{"model": "tiny", "prompt": "x"}',
        headers={"Content-Encoding": encoding, "Content-Type": "application/json"},
    )
    assert r.status == 400, r.text
    message = r.json()["error"]["message"] if path.startswith("/v1") else r.json()["message"]
    assert "body" in message
    assert server.predict(TINY).status == 200


@pytest.mark.parametrize("encoding", ["gzip", "deflate"])
def test_compressed_bodies_are_read_and_their_decompressed_size_is_capped(server, encoding):
    compress = gzip.compress if encoding == "gzip" else zlib.compress
    headers = {"Content-Encoding": encoding, "Content-Type": "application/json"}
    ok = compress(json.dumps({"prompt": "1, 2, 3,", "max_tokens": 2}).encode())
    assert server.post("inference", f"/predictions/{TINY}", data=ok, headers=headers).status == 200
    bomb = compress(json.dumps({"prompt": "x" * (20 * MAX_REQUEST)}).encode())
    assert len(bomb) < MAX_REQUEST
    r = server.post("inference", f"/predictions/{TINY}", data=bomb, headers=headers)
    assert "max_request_size" in torchserve_error(r, 413)["message"]


# -- a stream that fails after its headers went out (finding 6) ------------------------------


def _stream_raw(server, path: str, body: dict) -> tuple[int, bytes]:
    """POST and read the whole chunked reply; an unterminated stream times out (fails)."""
    conn = http.client.HTTPConnection("127.0.0.1", server.ports["inference"], timeout=60)
    conn.request(
        "POST",
        path,
        body=json.dumps(body),
        headers={"Authorization": f"Bearer {server.keys['inference']}", "Content-Type": "application/json"},
    )
    resp = conn.getresponse()
    data = resp.read()  # IncompleteRead / timeout unless the stream ends properly
    conn.close()
    return resp.status, data


@pytest.mark.parametrize("route", ["predictions", "completions"])
def test_a_stream_that_fails_midway_ends_with_an_error_event(server, monkeypatch, route):
    calls = []

    def failing_chunk(self, deltas):
        calls.append(1)
        if len(calls) > 1:
            raise RuntimeError("a shaping bug")
        return original(self, deltas)

    shaper = PredictionShaper if route == "predictions" else OpenAIShaper
    original = shaper.chunk
    monkeypatch.setattr(shaper, "chunk", failing_chunk)
    body = {"prompt": "Once upon a time", "max_tokens": 20, "ignore_eos": True, "stream": True}
    if route == "predictions":
        status, data = _stream_raw(server, f"/predictions/{TINY}", body)
        events = [json.loads(line) for line in data.splitlines() if line.strip()]
        error = events[-1]["error"]
    else:
        status, data = _stream_raw(server, "/v1/completions", {**body, "model": TINY})
        events = [line.removeprefix(b"data: ") for line in data.splitlines() if line.strip()]
        assert events[-1] == b"[DONE]"  # after the error event
        error = json.loads(events[-2])["error"]
    assert status == 200 and b"HTTP/1.1" not in data
    assert error["code"] == 500 and "internal error" in error["message"], error
    assert len(events) >= 2  # what was sent before the failure, then the error event
    monkeypatch.undo()
    assert server.predict(TINY).status == 200  # and the server serves on


# -- draining and the lifecycle ----------------------------------------------------------------


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return True


def test_drain_refuses_new_requests_by_route_then_waits_for_the_last_one(inprocess_factory):
    """The worker is stopped (SIGSTOP), so a request stays in flight; the stop that begins
    must wait for it (drain_grace is long) and end as soon as it is answered."""
    srv = inprocess_factory(load_models=[f"{TINY}={TINY_ARCHIVE}"], drain_grace=600)
    [version] = srv.state.registry.all_versions()
    [worker] = version.workers()
    pid = worker.pid
    held = http.client.HTTPConnection("127.0.0.1", srv.ports["inference"], timeout=120)
    os.kill(pid, signal.SIGSTOP)
    try:
        held.request(
            "POST",
            f"/predictions/{TINY}",
            body=json.dumps({"prompt": "x", "max_tokens": 2}),
            headers={"Authorization": f"Bearer {srv.keys['inference']}"},
        )
        srv.wait_for(lambda: srv.state.drain.in_flight == 1, 30, what="the request in flight")
        stopping = srv.submit(srv.server.stop())
        srv.wait_for(lambda: srv.state.draining, 30, what="draining")
        error = openai_error(srv.post("inference", "/v1/completions", json={"model": TINY, "prompt": "x"}), 503)
        assert "shutting down" in error["message"]
        assert "shutting down" in torchserve_error(srv.predict(TINY), 503)["message"]
        assert torchserve_error(srv.get("management", "/models"), 503)
        assert srv.get("inference", "/live").status == 503
        assert srv.get("inference", "/ping").json() == {"status": "Unhealthy"}
        assert not stopping.done()  # waiting for the held request, not for a timer
    finally:
        os.kill(pid, signal.SIGCONT)
    assert held.getresponse().status == 200
    stopping.result(120)  # the drain's event fired: no 600 s wait
    assert "aborting" not in srv.log_text()
    srv.wait_for(lambda: not _alive(pid), 30, what="the worker stopped by the lifecycle")
    assert srv.state.executor._shutdown


# -- no auth on a public address (finding 12) --------------------------------------------------


def test_auth_off_on_a_public_address_needs_allow_insecure():
    for address in ("0.0.0.0:8080", "10.1.2.3:8080", "[::]:8080", "example.com:8080"):
        with pytest.raises(ServerConfigError, match="--allow-insecure"):
            check_secure(ServerConfig(disable_token_auth=True, inference_address=address))
        with pytest.raises(ServerConfigError, match="management_address"):
            check_secure(ServerConfig(disable_token_auth=True, management_address=address))
        check_secure(ServerConfig(disable_token_auth=True, allow_insecure=True, inference_address=address))
        check_secure(ServerConfig(inference_address=address))  # auth on: fine
    for address in ("127.0.0.1:8080", "127.0.0.5:8080", "localhost:8080", "[::1]:8080"):
        check_secure(ServerConfig(disable_token_auth=True, inference_address=address))
    # The metrics port never needs a token: it may listen anywhere.
    check_secure(ServerConfig(disable_token_auth=True, metrics_address="0.0.0.0:8082"))


def test_serve_refuses_to_start_insecure_and_listens_with_allow_insecure(tmp_path, inprocess_factory):
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "pagedserve.server.cli",
            "serve",
            "--disable-token-auth",
            "--inference-address",
            "0.0.0.0:0",
            "--model-store",
            str(tmp_path),
        ],
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=300,
        check=False,
        env={**os.environ, "PYTHONPATH": str(REPO)},
    )
    assert proc.returncode == 2, proc.stderr
    assert "--allow-insecure" in proc.stderr and "inference_address=0.0.0.0:0" in proc.stderr
    assert not (tmp_path / "key_file.json").exists()
    srv = inprocess_factory(disable_token_auth=True, allow_insecure=True, inference_address="0.0.0.0:0")
    assert srv.get("inference", "/ping", token=None).status == 200


def test_server_start_raises_before_listening():
    server = Server(ServerConfig(disable_token_auth=True, management_address="0.0.0.0:0"), out=print)
    import asyncio

    with pytest.raises(ServerConfigError):
        asyncio.run(server.start())
    assert server.runners == [] and server.state is None
