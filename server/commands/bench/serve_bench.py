"""`pagedserve bench serve`: load a running server at each level of a sweep (a concurrency cap
with every request queued at once, or a request rate with Poisson arrivals) and summarize each
level (pagedserve.server.commands.bench.stats)."""

from __future__ import annotations

import asyncio
import math
import time
from collections.abc import Sequence
from dataclasses import dataclass

import aiohttp

from pagedserve.server.commands.bench.client import RequestResult, send
from pagedserve.server.commands.bench.stats import summarize
from pagedserve.server.commands.bench.workload import BenchRequest, arrival_gaps


@dataclass(frozen=True, slots=True)
class Level:
    """One point of the sweep: a concurrency cap, or a request rate (optionally capped too)."""

    concurrency: int | None = None
    request_rate: float | None = None

    @property
    def label(self) -> str:
        if self.request_rate is None:
            return f"c={self.concurrency}"
        rate = "inf" if math.isinf(self.request_rate) else f"{self.request_rate:g}"
        return f"{rate} req/s" + (f", c<={self.concurrency}" if self.concurrency else "")


def sweep(
    concurrencies: Sequence[int] | None, rates: Sequence[float] | None, max_concurrency: int | None
) -> list[Level]:
    """The levels the flags ask for: each request rate (capped by max_concurrency), else each
    concurrency (1 when neither is given)."""
    if rates:
        if any(r <= 0 for r in rates):
            raise ValueError("request-rate: each must be > 0 (inf for all at once)")
        return [Level(max_concurrency, r) for r in rates]
    levels = list(concurrencies or [1])
    if any(c < 1 for c in levels):
        raise ValueError("concurrency: each must be >= 1")
    return [Level(c) for c in levels]


@dataclass(slots=True)
class ServeTarget:
    base_url: str  # http://HOST:PORT of the inference port
    model: str | None = None  # None: the first of GET /v1/models
    api_key: str | None = None
    timeout_s: float = 600.0

    def session(self) -> aiohttp.ClientSession:
        headers = {"Authorization": f"Bearer {self.api_key}"} if self.api_key else {}
        # No connection cap: the sweep's concurrency is the only limit.
        return aiohttp.ClientSession(
            headers=headers,
            connector=aiohttp.TCPConnector(limit=0),
            timeout=aiohttp.ClientTimeout(total=self.timeout_s),
        )


async def resolve_model(session: aiohttp.ClientSession, target: ServeTarget) -> str:
    if target.model:
        return target.model
    async with session.get(target.base_url + "/v1/models") as resp:
        if resp.status != 200:
            raise ValueError(
                f"GET /v1/models answered {resp.status}: {(await resp.text())[:200]} "
                "(give --model, and the key with --api-key or --key-file)"
            )
        models = (await resp.json()).get("data") or []
    if not models:
        raise ValueError("the server has no model registered")
    return models[0]["id"]


async def run_level(
    session: aiohttp.ClientSession,
    url: str,
    model: str,
    requests: Sequence[BenchRequest],
    level: Level,
    *,
    burstiness: float = 1.0,
    seed: int = 0,
    ignore_eos: bool = True,
    progress=None,
) -> tuple[list[RequestResult], float]:
    """Send every request at this level; (results in request order, wall seconds)."""
    limit = asyncio.Semaphore(level.concurrency) if level.concurrency else None

    async def one(req: BenchRequest) -> RequestResult:
        if limit is None:
            result = await send(session, url, model, req, ignore_eos)
        else:
            async with limit:
                result = await send(session, url, model, req, ignore_eos)
        if progress is not None:
            progress.update(1)
        return result

    start = time.perf_counter()
    if level.request_rate is None:
        tasks = [asyncio.create_task(one(r)) for r in requests]
    else:
        tasks = []
        for req, gap in zip(requests, arrival_gaps(len(requests), level.request_rate, burstiness, seed)):
            if gap:
                await asyncio.sleep(gap)
            tasks.append(asyncio.create_task(one(req)))
    results = list(await asyncio.gather(*tasks))
    return results, time.perf_counter() - start


async def bench_serve(
    target: ServeTarget,
    workloads: Sequence[Sequence[BenchRequest]],
    levels: Sequence[Level],
    *,
    percentiles: Sequence[float],
    slos: dict[str, float],
    warmup: Sequence[BenchRequest] = (),
    burstiness: float = 1.0,
    seed: int = 0,
    ignore_eos: bool = True,
    show_progress: bool = True,
) -> dict:
    """Run the sweep (`workloads[i]`: what level i sends; `warmup`: sent first, one at a time,
    not counted); the JSON-ready record: the model, each level's numbers."""
    from tqdm import tqdm

    url = target.base_url + "/v1/completions"
    async with target.session() as session:
        model = await resolve_model(session, target)
        for req in warmup:  # first-use costs (kernels, allocations) stay out of the numbers
            result = await send(session, url, model, req, ignore_eos)
            if not result.ok:
                raise ValueError(f"the warm-up request failed: {result.error}")
        out = []
        for level, requests in zip(levels, workloads, strict=True):
            with tqdm(total=len(requests), desc=level.label, disable=not show_progress, unit="req", leave=False) as bar:
                results, duration = await run_level(
                    session,
                    url,
                    model,
                    requests,
                    level,
                    burstiness=burstiness,
                    seed=seed,
                    ignore_eos=ignore_eos,
                    progress=bar,
                )
            rate = level.request_rate
            out.append(
                {
                    "level": level.label,
                    "concurrency": level.concurrency,
                    "request_rate": None if rate is None else ("inf" if math.isinf(rate) else rate),
                    **summarize(results, duration, percentiles, slos),
                }
            )
    return {
        "model": model,
        "base_url": target.base_url,
        "num_prompts": len(workloads[0]),
        "percentiles": list(percentiles),
        "goodput_slos_ms": slos,
        "levels": out,
    }
