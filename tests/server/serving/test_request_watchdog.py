"""The request watchdog on a real server: responseTimeout ends a whole reply whose engine makes no
progress for that long with a 504 (one that keeps progressing is answered whole, however long it
takes) and a stream whose next chunk is overdue with a 504 error event; a client that hangs
up while its request still waits for the first token is noticed at once. Each case aborts the
request in the engine: afterwards every KV block is free and the worker serves on.

In-process, on the tiny model. Version 1.0 keeps the archive's responseTimeout (120 s); version
2.0 is registered with response_timeout=3. A worker stopped with SIGSTOP stands for an engine
that gives no output (no guess about how fast a machine generates)."""

from __future__ import annotations

import os
import signal
import socket
import threading
import time

import pytest

from tests.server import observe
from tests.server.conftest import TINY as MODEL
from tests.server.conftest import TINY_ARCHIVE as ARCHIVE
from tests.server.conftest import TINY_ARCHIVE_V2

QUICK = "2.0"  # the version with response_timeout=3
LONG = {"prompt": "Tell me a long story.", "max_tokens": 240, "ignore_eos": True, "temperature": 0}


@pytest.fixture(scope="module")
def server(inprocess_factory):
    server = inprocess_factory(load_models=[f"{MODEL}={ARCHIVE}"], enable_model_api=True)
    r = server.post("management", f"/models?url={TINY_ARCHIVE_V2}&response_timeout=3&synchronous=true")
    assert r.status == 200, r.text
    return server


def blocks_freed(server, version: str) -> None:
    server.wait_for(
        lambda: observe.all_blocks_free(server, MODEL, version), timeout=30, what=f"all KV blocks of {version} free"
    )
    assert observe.worker(server, MODEL, version)["status"] == "READY"
    r = server.predict(MODEL, version)
    assert r.status == 200 and r.json()["choices"][0]["text"], r.text


def test_whole_reply_past_response_timeout_is_504_and_aborted(server):
    [desc] = server.get("management", f"/models/{MODEL}/{QUICK}").json()
    assert desc["responseTimeout"] == 3
    pid = observe.worker(server, MODEL, QUICK)["pid"]
    replies = []
    asking = threading.Thread(
        target=lambda: replies.append(server.post("inference", f"/predictions/{MODEL}/{QUICK}", json=LONG))
    )
    os.kill(pid, signal.SIGSTOP)  # the engine gives no output at all
    try:
        asking.start()
        asking.join(120)
    finally:
        os.kill(pid, signal.SIGCONT)
    [r] = replies
    assert r.status == 504, r.text
    body = r.json()
    assert body["code"] == 504 and "responseTimeout" in body["message"]
    assert r.headers.get("x-request-id")
    blocks_freed(server, QUICK)


def test_a_whole_reply_that_keeps_progressing_outlives_response_timeout(server):
    """responseTimeout ends a request whose engine stops progressing, not one that runs long
    (issue 29): the worker is paused for 1.8 s at a time (less than the 3 s timeout) and let run
    0.15 s in between, so the reply takes several timeouts' worth of time and still comes whole."""
    pid = observe.worker(server, MODEL, QUICK)["pid"]
    done = threading.Event()

    def throttle() -> None:
        while not done.is_set():
            os.kill(pid, signal.SIGSTOP)
            done.wait(1.8)
            os.kill(pid, signal.SIGCONT)
            time.sleep(0.15)

    pauser = threading.Thread(target=throttle)
    started = time.monotonic()
    pauser.start()
    try:
        r = server.post("inference", f"/predictions/{MODEL}/{QUICK}", json=LONG)
    finally:
        done.set()
        pauser.join()
        os.kill(pid, signal.SIGCONT)
    assert r.status == 200, r.text
    assert r.json()["usage"]["completion_tokens"] == LONG["max_tokens"]
    assert time.monotonic() - started > 3.5  # longer than responseTimeout (3 s)


def test_stream_with_an_overdue_chunk_ends_with_a_504_event(server):
    pid = observe.worker(server, MODEL, QUICK)["pid"]
    try:  # the engine stalls mid-stream
        events = observe.stream_and_signal(
            server, {"model": f"{MODEL}@{QUICK}", **LONG}, after=1, pid=pid, sig=signal.SIGSTOP
        )
    finally:
        os.kill(pid, signal.SIGCONT)
    assert events[-1] == b"[DONE]"  # after the error event
    error = events[-2]["error"]
    assert error["code"] == 504 and "next chunk" in error["message"], error
    assert all("choices" in e for e in events[:-2])
    blocks_freed(server, QUICK)
    assert observe.worker(server, MODEL, QUICK)["pid"] == pid  # a timeout is not a worker restart


def test_hang_up_before_the_first_token_aborts_the_request(server):
    """The worker is stopped, so no first token can come: only the watchdog can notice that the
    client left. The request is counted (499) while the worker is still stopped."""
    pid = observe.worker(server, MODEL, "1.0")["pid"]
    before = observe.request_counts(server, MODEL).get("predictions:499", 0)
    os.kill(pid, signal.SIGSTOP)
    try:
        with socket.create_connection(("127.0.0.1", server.ports["inference"]), timeout=10) as sock:
            body = b'{"prompt": "Tell me a long story.", "max_tokens": 200, "ignore_eos": true}'
            sock.sendall(
                b"POST /predictions/" + MODEL.encode() + b"/1.0 HTTP/1.1\r\n"
                b"Host: 127.0.0.1\r\nContent-Type: application/json\r\n"
                b"Authorization: Bearer " + server.keys["inference"].encode() + b"\r\n"
                b"Content-Length: " + str(len(body)).encode() + b"\r\n\r\n" + body
            )
            server.wait_for(
                lambda: observe.worker(server, MODEL, "1.0")["requestsInFlight"] == 1,
                timeout=10,
                what="the request in flight",
            )
        # The socket is closed: the server must count the hang-up without any engine output.
        server.wait_for(
            lambda: observe.request_counts(server, MODEL).get("predictions:499", 0) == before + 1,
            timeout=10,
            what="the hang-up counted while the worker is stopped",
        )
        assert observe.worker(server, MODEL, "1.0")["requestsInFlight"] == 0
    finally:
        os.kill(pid, signal.SIGCONT)
    blocks_freed(server, "1.0")
