"""Streams under stress on a real server: a worker killed with SIGKILL mid-stream ends the
stream with an error event and comes back; 200 streaming requests from 32 concurrent clients,
some of which hang up mid-stream, get no 5xx, and afterwards every KV block is free."""

from __future__ import annotations

import asyncio
import random
import signal
import time

import aiohttp
import pytest

from tests.server import observe
from tests.server.conftest import ARCHIVE, MODEL
from tests.server.observe import read_events

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def server(module_server_factory):
    return module_server_factory(models=[f"{MODEL}={ARCHIVE}"])


def worker(server) -> dict:
    return observe.worker(server, MODEL)


def test_kill_9_mid_stream_ends_the_stream_with_an_error(server):
    before = worker(server)
    started = time.monotonic()
    body = {"model": MODEL, "prompt": "Tell me a long story.", "max_tokens": 400, "ignore_eos": True}
    events = observe.stream_and_signal(server, body, after=3, pid=before["pid"], sig=signal.SIGKILL)
    assert time.monotonic() - started < 30  # no hang: the death is noticed within seconds
    assert events[-1] == b"[DONE]"  # after the error event
    error = events[-2]["error"]
    assert error["code"] == 503 and "died" in error["message"]
    assert all("choices" in e for e in events[:-2]) and len(events) < 400

    server.wait_for(
        lambda: worker(server)["status"] == "READY" and worker(server)["pid"] != before["pid"],
        timeout=180,
        what="worker restarted",
    )
    r = server.predict(MODEL)
    assert r.status == 200 and r.json()["choices"][0]["text"]


def test_200_streams_from_32_clients_with_disconnects_leave_no_block_behind(server):
    headers = {"Authorization": f"Bearer {server.keys['inference']}"}
    rng = random.Random(1234)
    topics = ["the sea", "a robot", "numbers", "a city at night", "the moon", "bread", "winter", "a river"]
    plans = []
    for i in range(200):
        kind = rng.choice(["completions", "chat", "predictions"])
        prompt = f"Write about {rng.choice(topics)} (request {i})."
        hang_up_after = rng.randint(1, 4) if rng.random() < 0.3 else None
        plans.append((kind, prompt, rng.randint(6, 12), hang_up_after))
    before = observe.request_counts(server, MODEL)

    async def one(
        session: aiohttp.ClientSession, kind: str, prompt: str, max_tokens: int, hang_up_after: int | None
    ) -> tuple[str, int]:
        if kind == "chat":
            url, sse = server.url("inference", "/v1/chat/completions"), True
            body = {"model": MODEL, "messages": [{"role": "user", "content": prompt}]}
        elif kind == "completions":
            url, sse = server.url("inference", "/v1/completions"), True
            body = {"model": MODEL, "prompt": prompt}
        else:
            url, sse = server.url("inference", f"/predictions/{MODEL}"), False
            body = {"prompt": prompt}
        body.update(max_tokens=max_tokens, ignore_eos=True, stream=True)
        async with session.post(url, json=body) as resp:
            if resp.status != 200:
                return "status", resp.status
            events = 0
            async for event in read_events(resp, sse):
                events += 1
                if hang_up_after is not None and events >= hang_up_after:
                    resp.close()  # hang up mid-stream
                    return "disconnected", 200
                if event == b"[DONE]" or (not sse and event["choices"] and event["choices"][0]["finish_reason"]):
                    return "complete", 200
                assert "error" not in event, event
            return "truncated", 200

    async def run():
        queue: asyncio.Queue = asyncio.Queue()
        for plan in plans:
            queue.put_nowait(plan)
        results = []

        async def client():
            async with aiohttp.ClientSession(headers=headers) as session:
                while not queue.empty():
                    results.append(await one(session, *queue.get_nowait()))

        await asyncio.gather(*(client() for _ in range(32)))
        return results

    results = asyncio.run(run())
    outcomes = {}
    for outcome, status in results:
        outcomes[outcome] = outcomes.get(outcome, 0) + 1
        assert status == 200, results
    expected_hangups = sum(1 for p in plans if p[3] is not None)
    assert outcomes.get("truncated", 0) == 0 and outcomes.get("status", 0) == 0, outcomes
    assert outcomes["complete"] + outcomes.get("disconnected", 0) == 200
    assert 0 < outcomes.get("disconnected", 0) <= expected_hangups  # a short stream may finish first

    # The server saw no 5xx, and every hang-up it noticed is a 499, not an error.
    after = observe.request_counts(server, MODEL)
    new = {k: after.get(k, 0) - before.get(k, 0) for k in after}
    assert not [k for k, v in new.items() if v and k.split(":")[1].startswith("5")], new
    assert sum(v for k, v in new.items() if k.endswith((":200", ":499"))) == 200
    assert sum(v for k, v in new.items() if k.endswith(":499")) > 0  # hang-ups reached the server

    # Every KV block is free again (the gauges are pushed by the worker about once a second).
    server.wait_for(lambda: observe.all_blocks_free(server, MODEL), timeout=30, what="all KV blocks free")
    g = observe.gauges(server, MODEL)
    assert g["pagedserve_kv_blocks_free"] > 0 and g["pagedserve_kv_blocks_used"] == 0
    assert worker(server)["requestsInFlight"] == 0 and worker(server)["status"] == "READY"
