"""Engine outputs -> Ollama's replies, as `pagedserve.server.serving.generation.Shaper`s: /api/generate's
`response` and /api/chat's `message`, whole or streamed as NDJSON (one object per line, the
last with `done: true`, `done_reason` and the timing fields), and the embeddings replies.

Timings are Ollama's, in nanoseconds: `total_duration` (the front end's measure),
`load_duration` (time spent loading the model for this request, 0 when it was loaded),
`prompt_eval_count` / `prompt_eval_duration` (the prompt's tokens and its prefill),
`eval_count` / `eval_duration` (generated tokens and the decode). pagedserve's own `timings`
record rides along, as on every other route.

With tools, a choice's text is held until it finishes (a call cannot be told from text before
then); its calls are then sent in `message.tool_calls` with arguments as objects, as Ollama does.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from datetime import datetime, timezone
from typing import Any

from pagedserve.engine.request.outputs import RequestOutput
from pagedserve.handlers.deltas import ChoiceDelta
from pagedserve.handlers.llm_output import timings
from pagedserve.handlers.openai_tools import ToolParser, ToolRequest, parse_output
from pagedserve.server.serving.streaming import StreamFormat

NS = 1_000_000_000


def now_iso() -> str:
    """Ollama's `created_at`: UTC with nanosecond-looking precision."""
    return datetime.now(timezone.utc).isoformat(timespec="microseconds").replace("+00:00", "Z")


def durations(out: RequestOutput, total_s: float, load_s: float) -> dict[str, Any]:
    """The final chunk's timing fields, in nanoseconds."""
    m = out.metrics
    return {
        "total_duration": int(total_s * NS),
        "load_duration": int(load_s * NS),
        "prompt_eval_count": len(out.prompt_token_ids),
        "prompt_eval_duration": int((m.prefill_s if m else 0.0) * NS),
        "eval_count": sum(len(c.token_ids) for c in out.outputs),
        "eval_duration": int((m.decode_s if m else 0.0) * NS),
    }


def done_reason(out: RequestOutput) -> str:
    reason = out.outputs[0].finish_reason if out.outputs else None
    return "length" if reason == "length" else "stop"


@dataclass(slots=True)
class OllamaShaper:
    """/api/generate (`chat` False) or /api/chat replies."""

    model: str
    chat: bool
    load_s: float = 0.0
    tools: ToolRequest | None = None
    tool_parser: ToolParser = ToolParser.HERMES
    stream_format: StreamFormat = StreamFormat.NDJSON
    _held: str = ""  # the text held back while tools are offered

    def whole(self, out: RequestOutput, total_s: float) -> dict[str, Any]:
        body = self._body(out.outputs[0].text, done=True)
        return self._finish(body, out, total_s)

    def opening(self, n: int) -> None:
        return None

    def chunk(self, deltas: list[ChoiceDelta]) -> dict[str, Any] | None:
        text = "".join(d.text for d in deltas)
        if self.tools is not None:
            self._held += text
            return None
        return self._body(text, done=False) if text else None

    def closing(self, deltas: list[ChoiceDelta], out: RequestOutput, total_s: float) -> list[dict[str, Any]]:
        text = "".join(d.text for d in deltas)
        if self.tools is not None:
            text, self._held = self._held + text, ""
        last = self._body(text, done=True)
        return [self._finish(last, out, total_s)]

    def error(self, code: int, message: str) -> dict[str, Any]:
        return {"error": message}

    def _body(self, text: str, *, done: bool) -> dict[str, Any]:
        body: dict[str, Any] = {"model": self.model, "created_at": now_iso()}
        if not self.chat:
            body["response"] = text
        else:
            message: dict[str, Any] = {"role": "assistant", "content": text}
            if done and self.tools is not None:
                parsed = parse_output(text, self.tools, self.tool_parser)
                message["content"] = parsed.content or ""
                if parsed.calls:
                    message["tool_calls"] = [
                        {"function": {"name": c.name, "arguments": json.loads(c.arguments)}} for c in parsed.calls
                    ]
            body["message"] = message
        body["done"] = done
        return body

    def _finish(self, body: dict[str, Any], out: RequestOutput, total_s: float) -> dict[str, Any]:
        body["done_reason"] = done_reason(out)
        body.update(durations(out, total_s, self.load_s))
        body["timings"] = timings(out, total_s)
        return body


@dataclass(slots=True)
class EmbedShaper:
    """/api/embed (`legacy` False: `embeddings`, one per input) or /api/embeddings (`embedding`):
    whole replies only (a `WholeShaper`: embeddings are never streamed)."""

    model: str
    legacy: bool = False
    load_s: float = 0.0
    stream_format: StreamFormat = StreamFormat.NDJSON

    def whole(self, out: RequestOutput, total_s: float) -> dict[str, Any]:
        vectors = [c.embedding for c in sorted(out.outputs, key=lambda c: c.index)]
        if self.legacy:
            return {"embedding": vectors[0]}
        return {
            "model": self.model,
            "embeddings": vectors,
            "total_duration": int(total_s * NS),
            "load_duration": int(self.load_s * NS),
            "prompt_eval_count": len(out.prompt_token_ids),
            "timings": timings(out, total_s),
        }

    def error(self, code: int, message: str) -> dict[str, Any]:
        return {"error": message}
