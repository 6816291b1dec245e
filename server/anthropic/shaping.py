"""Engine outputs -> Anthropic Messages replies and stream events, as a
`pagedserve.server.serving.generation.Shaper`.

A reply is a `message` with content blocks (`text`, `tool_use` with `input` as an object),
`stop_reason` (`end_turn`, `max_tokens`, `stop_sequence` with the `stop_sequence` that ended it,
`tool_use`) and `usage` (`input_tokens`, `output_tokens`, `cache_read_input_tokens`: prompt
tokens served from the prefix cache), plus pagedserve's `timings`.

Streamed as Anthropic streams (SSE, each event named by its type): `message_start` (the
message with empty content), `ping`, then per block `content_block_start`,
`content_block_delta` (`text_delta`; `input_json_delta` for a call's input) and
`content_block_stop`, then `message_delta` (stop_reason, output tokens) and `message_stop`. With
tools the text is held until the choice finishes (a call cannot be told from text before then).
An error after the stream opened is an `error` event.
"""

from __future__ import annotations

import json
import uuid
from dataclasses import dataclass
from typing import Any

from pagedserve.engine.request.outputs import RequestOutput
from pagedserve.handlers.deltas import ChoiceDelta
from pagedserve.handlers.llm_output import timings
from pagedserve.handlers.openai_tools import ToolParser, ToolRequest, parse_output
from pagedserve.server.serving.streaming import StreamFormat

ERROR_TYPES = {
    400: "invalid_request_error",
    401: "authentication_error",
    403: "permission_error",
    404: "not_found_error",
    413: "request_too_large",
    429: "rate_limit_error",
    503: "overloaded_error",
    529: "overloaded_error",
}


def error_body(code: int, message: str) -> dict[str, Any]:
    """Anthropic's error shape."""
    kind = ERROR_TYPES.get(code, "invalid_request_error" if code < 500 else "api_error")
    return {"type": "error", "error": {"type": kind, "message": message}}


@dataclass(slots=True)
class AnthropicShaper:
    model: str
    input_tokens: int
    tools: ToolRequest | None = None
    tool_parser: ToolParser = ToolParser.HERMES
    message_id: str = ""
    stream_format: StreamFormat = StreamFormat.SSE_EVENTS
    _held: str = ""

    def __post_init__(self) -> None:
        self.message_id = self.message_id or "msg_" + uuid.uuid4().hex[:24]

    # -- whole -------------------------------------------------------------------------------
    def whole(self, out: RequestOutput, total_s: float) -> dict[str, Any]:
        choice = out.outputs[0]
        blocks, stop_reason, stop_sequence = self._blocks(choice.text, choice.finish_reason, choice.stop_reason)
        body = self._message(blocks, stop_reason, stop_sequence, _usage(out))
        body["timings"] = timings(out, total_s)
        return body

    # -- streamed ----------------------------------------------------------------------------
    def opening(self, n: int) -> list[dict[str, Any]]:
        usage = {"input_tokens": self.input_tokens, "output_tokens": 0}
        events = [{"type": "message_start", "message": self._message([], None, None, usage)}]
        if self.tools is None:
            events.append(_block_start(0, {"type": "text", "text": ""}))
        return events + [{"type": "ping"}]

    def chunk(self, deltas: list[ChoiceDelta]) -> list[dict[str, Any]]:
        text = "".join(d.text for d in deltas)
        if self.tools is not None:
            self._held += text
            return []
        return [_text_delta(0, text)] if text else []

    def closing(self, deltas: list[ChoiceDelta], out: RequestOutput, total_s: float) -> list[dict[str, Any]]:
        choice = out.outputs[0]
        text = "".join(d.text for d in deltas)
        events: list[dict[str, Any]] = []
        if self.tools is None:
            if text:
                events.append(_text_delta(0, text))
            events.append({"type": "content_block_stop", "index": 0})
        blocks, stop_reason, stop_sequence = self._blocks(self._held + text, choice.finish_reason, choice.stop_reason)
        if self.tools is not None:
            for i, block in enumerate(blocks):
                events += _streamed_block(i, block)
        usage = _usage(out)
        events.append(
            {
                "type": "message_delta",
                "delta": {"stop_reason": stop_reason, "stop_sequence": stop_sequence},
                "usage": {"output_tokens": usage["output_tokens"]},
                "timings": timings(out, total_s),
            }
        )
        events.append({"type": "message_stop"})
        return events

    def error(self, code: int, message: str) -> dict[str, Any]:
        return error_body(code, message)

    # -- helpers -----------------------------------------------------------------------------
    def _message(
        self, content: list[dict[str, Any]], stop_reason: str | None, stop_sequence: str | None, usage: dict[str, Any]
    ) -> dict[str, Any]:
        return {
            "id": self.message_id,
            "type": "message",
            "role": "assistant",
            "model": self.model,
            "content": content,
            "stop_reason": stop_reason,
            "stop_sequence": stop_sequence,
            "usage": usage,
        }

    def _blocks(
        self, text: str, finish_reason: str | None, stop: int | str | None
    ) -> tuple[list[dict[str, Any]], str, str | None]:
        """The content blocks of a finished choice, its stop_reason and stop_sequence."""
        calls = []
        if self.tools is not None:
            parsed = parse_output(text, self.tools, self.tool_parser)
            text, calls = parsed.content or "", parsed.calls
        blocks = [{"type": "text", "text": text}] if text or not calls else []
        blocks += [
            {
                "type": "tool_use",
                "id": "toolu_" + c.id.removeprefix("call_"),
                "name": c.name,
                "input": json.loads(c.arguments),
            }
            for c in calls
        ]
        if calls and (finish_reason == "stop" or (self.tools is not None and self.tools.forced)):
            return blocks, "tool_use", None
        if finish_reason == "length":
            return blocks, "max_tokens", None
        if isinstance(stop, str):
            return blocks, "stop_sequence", stop
        return blocks, "end_turn", None


def _usage(out: RequestOutput) -> dict[str, Any]:
    return {
        "input_tokens": len(out.prompt_token_ids),
        "output_tokens": sum(len(c.token_ids) for c in out.outputs),
        "cache_read_input_tokens": out.num_cached_tokens,
        "cache_creation_input_tokens": 0,
    }


def _block_start(index: int, block: dict[str, Any]) -> dict[str, Any]:
    return {"type": "content_block_start", "index": index, "content_block": block}


def _text_delta(index: int, text: str) -> dict[str, Any]:
    return {"type": "content_block_delta", "index": index, "delta": {"type": "text_delta", "text": text}}


def _streamed_block(index: int, block: dict[str, Any]) -> list[dict[str, Any]]:
    if block["type"] == "text":
        events = [_block_start(index, {"type": "text", "text": ""})]
        if block["text"]:
            events.append(_text_delta(index, block["text"]))
    else:
        events = [
            _block_start(index, {**block, "input": {}}),
            {
                "type": "content_block_delta",
                "index": index,
                "delta": {"type": "input_json_delta", "partial_json": json.dumps(block["input"])},
            },
        ]
    return events + [{"type": "content_block_stop", "index": index}]
