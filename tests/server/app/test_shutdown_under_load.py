"""SIGTERM under load, observed from start to exit (issue 34), on a real `pagedserve serve`
process with the default model:

- streams longer than drain_grace each end with an error event, then `[DONE]`;
- every non-streaming request gets its answer or a 503;
- every new request during the drain (a fresh connection each time) gets 503 with
  Retry-After; none is refused while the process lives;
- the process exits 0 and leaves no worker process behind.
"""

from __future__ import annotations

import asyncio
import json
import signal
import time

import aiohttp
import psutil

from tests.server.conftest import ARCHIVE, MODEL

GRACE_S = 4.0
STREAMS = 3
WHOLE = 2
LONG = {
    "model": MODEL,
    "prompt": "Tell me a very long story about the sea.",
    "max_tokens": 1800,
    "ignore_eos": True,
    "temperature": 0,
}


async def _stream(session: aiohttp.ClientSession, url: str, started: asyncio.Event) -> list:
    events: list = []
    async with session.post(url, json={**LONG, "stream": True}) as resp:
        assert resp.status == 200
        async for raw in resp.content:
            line = raw.strip()
            if not line:
                continue
            assert line.startswith(b"data: "), line
            data = line[len(b"data: ") :]
            events.append(data if data == b"[DONE]" else json.loads(data))
            started.set()
    return events


async def _whole(session: aiohttp.ClientSession, url: str) -> tuple[int, dict]:
    async with session.post(url, json=LONG) as resp:
        return resp.status, await resp.json()


async def _observe_drain(server, headers: dict) -> list[tuple[float, object]]:
    """New requests on fresh connections until the process is gone: (time, status or error)."""
    seen: list[tuple[float, object]] = []
    url = server.url("inference", "/v1/models")
    while server.proc.poll() is None:
        try:
            async with (
                aiohttp.ClientSession(headers=headers, connector=aiohttp.TCPConnector(force_close=True)) as s,
                s.get(url, timeout=aiohttp.ClientTimeout(total=10)) as resp,
            ):
                seen.append((time.monotonic(), (resp.status, resp.headers.get("Retry-After"), await resp.text())))
        except aiohttp.ClientConnectorError as exc:
            seen.append((time.monotonic(), exc))
        except (aiohttp.ClientError, asyncio.TimeoutError) as exc:
            seen.append((time.monotonic(), exc))
        await asyncio.sleep(0.05)
    return seen


def test_sigterm_under_load_ends_every_stream_and_exits_0(module_server_factory):
    # The C++ kernels are not what this is about (and building them per checkout takes minutes).
    server = module_server_factory(
        models=[f"{MODEL}={ARCHIVE}"], config={"drain_grace": GRACE_S}, env={"PAGEDSERVE_DISABLE_CPU_KERNELS": "1"}
    )
    workers = psutil.Process(server.proc.pid).children(recursive=True)
    assert workers, "the model's worker process"
    headers = {"Authorization": f"Bearer {server.keys['inference']}"}
    completions = server.url("inference", "/v1/completions")

    async def run():
        async with aiohttp.ClientSession(headers=headers) as session:
            started = [asyncio.Event() for _ in range(STREAMS)]
            streams = [asyncio.create_task(_stream(session, completions, e)) for e in started]
            whole = [asyncio.create_task(_whole(session, completions)) for _ in range(WHOLE)]
            await asyncio.wait_for(asyncio.gather(*(e.wait() for e in started)), 120)
            server.proc.send_signal(signal.SIGTERM)
            signalled = time.monotonic()
            observed = await _observe_drain(server, headers)
            return signalled, await asyncio.gather(*streams), await asyncio.gather(*whole), observed

    signalled, streams, whole, observed = asyncio.run(run())
    exited = time.monotonic()
    assert server.proc.wait(30) == 0, server.log_tail()
    print(
        f"\ndrain: {len(observed)} new requests over {exited - signalled:.1f}s "
        f"(grace {GRACE_S:g}s); answers {sorted({str(o[0]) if isinstance(o, tuple) else type(o).__name__ for _, o in observed})}"
    )

    for events in streams:
        assert events[-1] == b"[DONE]", events[-3:]
        error = events[-2]["error"]
        assert error["code"] == 503 and "shut down" in error["message"], error
        assert all("choices" in e for e in events[:-2]) and len(events) > 2
    for status, body in whole:
        assert status in (200, 503), (status, body)
    assert observed, "no request was tried during the drain"
    answered = [when for when, o in observed if isinstance(o, tuple)]
    refused = [when for when, o in observed if not isinstance(o, tuple)]
    for _when, outcome in observed:
        if isinstance(outcome, tuple):
            status, retry_after, text = outcome
            assert status == 503 and retry_after, outcome
    # The ports close last, as the process exits: no refusal before the last 503, and the
    # refusals all fall in the final moment (the observer polls every ~50 ms).
    window = exited - min(refused) if refused else 0.0
    print(
        f"drain: {len(answered)} answered 503 + Retry-After, {len(refused)} refused in the "
        f"last {window * 1000:.0f} ms before the exit was seen"
    )
    assert not refused or min(refused) > max(answered)
    assert window < 1.0, window
    gone = psutil.wait_procs(workers, timeout=10)[1]
    assert not gone, f"workers left behind: {gone}"
