"""One streamed request to a running server's `/v1/completions`, timed at the client: time to
the first text, the gaps between text chunks, the whole request, and the token counts from the
final usage chunk."""

from __future__ import annotations

import json
import time
from dataclasses import dataclass, field

import aiohttp

from pagedserve.server.commands.bench.workload import BenchRequest


@dataclass(slots=True)
class RequestResult:
    ok: bool
    prompt_tokens: int = 0
    output_tokens: int = 0
    ttft_s: float = 0.0  # send to first text chunk
    e2e_s: float = 0.0  # send to the end of the stream
    itl_s: list[float] = field(default_factory=list)  # gaps between text chunks
    error: str | None = None

    @property
    def tpot_s(self) -> float | None:
        """Decode time per output token after the first (None with fewer than 2 tokens)."""
        if self.output_tokens < 2:
            return None
        return (self.e2e_s - self.ttft_s) / (self.output_tokens - 1)


async def send(
    session: aiohttp.ClientSession, url: str, model: str, req: BenchRequest, ignore_eos: bool = True
) -> RequestResult:
    """POST one streamed completion and time it; a failure is a result with `error` set."""
    body = {
        "model": model,
        "prompt": req.prompt,
        "max_tokens": req.max_tokens,
        "temperature": 0,
        "ignore_eos": ignore_eos,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    start = time.perf_counter()
    result = RequestResult(ok=False)
    last = None
    chunks = 0
    try:
        async with session.post(url, json=body) as resp:
            if resp.status != 200:
                text = (await resp.text())[:300]
                result.error = f"HTTP {resp.status}: {text}"
                return result
            async for raw in resp.content:
                line = raw.strip()
                if not line.startswith(b"data: "):
                    continue
                data = line[len(b"data: ") :]
                if data == b"[DONE]":
                    break
                event = json.loads(data)
                if "error" in event:
                    result.error = str(event["error"])[:300]
                    return result
                now = time.perf_counter()
                if any(c.get("text") for c in event.get("choices") or ()):
                    chunks += 1
                    if last is None:
                        result.ttft_s = now - start
                    else:
                        result.itl_s.append(now - last)
                    last = now
                usage = event.get("usage")
                if usage:
                    result.prompt_tokens = usage.get("prompt_tokens", 0)
                    result.output_tokens = usage.get("completion_tokens", 0)
    except (aiohttp.ClientError, TimeoutError, json.JSONDecodeError) as exc:
        result.error = f"{type(exc).__name__}: {exc}"
        return result
    result.e2e_s = time.perf_counter() - start
    if last is None:
        result.error = "the stream carried no text"
        return result
    result.output_tokens = result.output_tokens or chunks
    result.ok = True
    return result
