"""The last 15 minutes of the metrics the console charts, so a page opened now draws them.

A background task on the management app (`history_context`) renders the chart families of the
server's own metrics registry every `SAMPLE_S` seconds — the same Prometheus text the metrics
port and `GET /console/api/metrics` answer, nothing computed anew — and keeps the samples of the
last `WINDOW_S` seconds, each zlib-compressed (a few hundred bytes). `GET /console/api/history`
(management key) returns them; the page parses them exactly as the texts it polls itself.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
import zlib
from collections import deque
from collections.abc import AsyncIterator
from dataclasses import dataclass, field

from aiohttp import web

from pagedserve.engine.config.schema import SchemaError
from pagedserve.server.serving.state import STATE_KEY

WINDOW_S = 15 * 60
SAMPLE_S = 2.0
# What the charts read (server/console/console_static/js/charts.js): families by name.
CHART_FAMILIES = (
    "pagedserve_generation_tokens",
    "pagedserve_requests",
    "pagedserve_num_requests_waiting",
    "pagedserve_num_requests_running",
    "pagedserve_preemptions",
    "pagedserve_time_to_first_token_seconds",
    "pagedserve_inter_token_latency_seconds",
)


@dataclass(slots=True, eq=False)
class MetricsHistory:
    """Timestamped, compressed samples of the chart families, oldest first, `window_s` long."""

    window_s: float = WINDOW_S
    samples: deque[tuple[float, bytes]] = field(default_factory=deque)

    def add(self, t: float, text: bytes) -> None:
        self.samples.append((t, zlib.compress(text, 6)))
        while self.samples and self.samples[0][0] < t - self.window_s:
            self.samples.popleft()

    def since(self, t: float) -> list[dict]:
        return [{"t": round(ts, 3), "metrics": zlib.decompress(z).decode()} for ts, z in self.samples if ts > t]

    def nbytes(self) -> int:
        return sum(len(z) for _, z in self.samples)


HISTORY_KEY = web.AppKey("pagedserve_console_history", MetricsHistory)


async def history_context(app: web.Application) -> AsyncIterator[None]:
    """Sample the chart families while the management app runs."""
    history = app[HISTORY_KEY]
    metrics = app[STATE_KEY].metrics

    async def sample() -> None:
        while True:
            history.add(time.time(), metrics.render(CHART_FAMILIES))
            await asyncio.sleep(SAMPLE_S)

    task = asyncio.create_task(sample())
    yield
    task.cancel()
    with contextlib.suppress(asyncio.CancelledError):
        await task


async def history(request: web.Request) -> web.Response:
    """The chart metrics of the last 15 minutes, one Prometheus text per 2 s sample (`since`:
    only samples after this Unix time)."""
    try:
        since = float(request.query.get("since", "0"))
    except ValueError:
        raise SchemaError("since: a Unix time in seconds", "since") from None
    return web.json_response({"sampleSeconds": SAMPLE_S, "samples": request.app[HISTORY_KEY].since(since)})


def setup(app: web.Application) -> None:
    app[HISTORY_KEY] = MetricsHistory()
    app.router.add_get("/console/api/history", history)
    app.cleanup_ctx.append(history_context)
