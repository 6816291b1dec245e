"""What tests read back from a running server: engine gauges and request counts on the metrics
port, a model version's worker, and the events of an SSE or NDJSON stream."""

from __future__ import annotations

import asyncio
import json
import os
import re

import aiohttp

from tests.server.server_process import ServerProcess


def worker(server: ServerProcess, model: str, version: str | None = None) -> dict:
    """The description of the only worker of `model` (its default version unless named)."""
    [desc] = server.get("management", f"/models/{model}" + (f"/{version}" if version else "")).json()
    [w] = desc["workers"]
    return w


def gauges(server: ServerProcess, model: str, version: str = "1.0") -> dict[str, float]:
    """The engine gauges of one model version on the metrics port."""
    values = {}
    pattern = re.compile(
        r'(pagedserve_\w+)\{model="' + re.escape(model) + r'",version="' + re.escape(version) + r'"\} (\S+)$'
    )
    for line in server.get("metrics", "/metrics").text.splitlines():
        m = pattern.match(line)
        if m:
            values[m.group(1)] = float(m.group(2))
    return values


def all_blocks_free(server: ServerProcess, model: str, version: str = "1.0") -> bool:
    """No request running, waiting or in flight, and no KV block used (the gauges are pushed by
    the worker about once a second: poll this with `server.wait_for`)."""
    g = gauges(server, model, version)
    return (
        g.get("pagedserve_kv_blocks_used") == 0
        and g.get("pagedserve_num_requests_running") == 0
        and g.get("pagedserve_num_requests_waiting") == 0
        and g.get("pagedserve_requests_in_flight") == 0
    )


def request_counts(server: ServerProcess, model: str) -> dict[str, float]:
    """pagedserve_requests_total of `model`, as {"endpoint:status": count}."""
    counts: dict[str, float] = {}
    pattern = re.compile(
        r'pagedserve_requests_total\{endpoint="(\w+)",model="' + re.escape(model) + r'",status="(\d+)"\} (\S+)$'
    )
    for line in server.get("metrics", "/metrics").text.splitlines():
        m = pattern.match(line)
        if m:
            key = f"{m.group(1)}:{m.group(2)}"
            counts[key] = counts.get(key, 0) + float(m.group(3))
    return counts


async def read_events(resp: aiohttp.ClientResponse, sse: bool):
    """Yield each event of an SSE or NDJSON stream as it arrives (bytes for `[DONE]`)."""
    async for raw in resp.content:
        line = raw.strip()
        if not line:
            continue
        if sse:
            assert line.startswith(b"data: "), line
            line = line[len(b"data: ") :]
            if line == b"[DONE]":
                yield b"[DONE]"
                continue
        yield json.loads(line)


def stream_and_signal(
    server: ServerProcess, body: dict, *, after: int, pid: int, sig: int, timeout: float = 60.0
) -> list:
    """Stream `body` from /v1/completions, send `sig` to `pid` once `after` events arrived, and
    return every event of the stream (it must open with 200)."""
    headers = {"Authorization": f"Bearer {server.keys['inference']}"}

    async def run() -> list:
        async with (
            aiohttp.ClientSession(headers=headers) as session,
            session.post(server.url("inference", "/v1/completions"), json={**body, "stream": True}) as resp,
        ):
            assert resp.status == 200
            events = []
            async for event in read_events(resp, sse=True):
                events.append(event)
                if len(events) == after:
                    os.kill(pid, sig)
            return events

    return asyncio.run(asyncio.wait_for(run(), timeout))
