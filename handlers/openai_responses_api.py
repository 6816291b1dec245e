"""POST /v1/responses (OpenAI's Responses API), stateless: the body becomes a chat request
(pagedserve.handlers.openai_protocol) and the engine's output becomes a `response` object or its stream
of typed events.

Supported: `input` as text or a list of items (messages with text content, `function_call` and
`function_call_output` items), `instructions` (a system message first), `max_output_tokens`,
`temperature`, `top_p`, `text.format` (`text`, `json_object`, `json_schema`), function `tools`
with `tool_choice` and `parallel_tool_calls`, `stream`. Refused with a 400 naming the field:
`previous_response_id` and `store: true` (nothing is stored), `background: true`, `reasoning`,
`conversation`, `prompt`, and non-function tools (web search, file search, ...).

Streamed events: response.created, response.in_progress; for a text reply
response.output_item.added, response.content_part.added, response.output_text.delta (per
chunk), response.output_text.done, response.content_part.done, response.output_item.done; for
each function call response.output_item.added, response.function_call_arguments.delta and
.done, response.output_item.done (a reply with tools is held until it ends, as on chat); then
response.completed (or response.incomplete at max_output_tokens).
"""

from __future__ import annotations

import uuid
from dataclasses import dataclass, field
from typing import Annotated, Any, Literal

import msgspec
from msgspec import Meta

from pagedserve.engine.request.outputs import FinishReason, RequestOutput
from pagedserve.engine.sampling.params import MAX_TOKENS
from pagedserve.handlers.deltas import ChoiceDelta
from pagedserve.handlers.errors import HandlerError
from pagedserve.handlers.llm_input import convert_body
from pagedserve.handlers.llm_output import timings
from pagedserve.handlers.openai_protocol import OpenAIRequest, parse_chat_request
from pagedserve.handlers.openai_tools import ToolParser, parse_output


class FunctionTool(msgspec.Struct, forbid_unknown_fields=True, omit_defaults=True):
    type: Literal["function"]
    name: str
    parameters: dict[str, Any] | None = None
    description: str | None = None
    strict: bool | None = None


class ResponseFormat(msgspec.Struct, forbid_unknown_fields=True, omit_defaults=True):
    type: Literal["text", "json_object", "json_schema"]
    name: str | None = None
    schema: dict[str, Any] | None = None
    description: str | None = None
    strict: bool | None = None


class TextConfig(msgspec.Struct, forbid_unknown_fields=True):
    format: ResponseFormat | None = None
    verbosity: Any = None


class ResponsesBody(msgspec.Struct, forbid_unknown_fields=True, kw_only=True):
    model: Annotated[str, Meta(min_length=1)] | None = None
    input: str | Annotated[list[dict[str, Any]], Meta(min_length=1)]
    instructions: str | None = None
    max_output_tokens: Annotated[int, Meta(ge=1, le=MAX_TOKENS)] | None = None
    temperature: float | None = None
    top_p: float | None = None
    text: TextConfig | None = None
    tools: list[FunctionTool] | None = None
    tool_choice: Literal["none", "auto", "required"] | dict[str, Any] | None = None  # or {"type": "function", "name"}
    parallel_tool_calls: bool | None = None
    stream: bool = False
    priority: int | None = None  # vLLM's: lower first under scheduling_policy "priority"
    cache_salt: str | None = None  # vLLM's: prefix-cache hits only among requests with the same salt
    store: bool | None = None
    previous_response_id: str | None = None
    background: bool | None = None
    reasoning: Any = None
    conversation: Any = None
    prompt: Any = None
    # Accepted, no effect here.
    metadata: dict[str, Any] | None = None
    user: str | None = None
    truncation: str | None = None
    include: list[str] | None = None
    service_tier: Any = None
    prompt_cache_key: Any = None
    safety_identifier: Any = None


@dataclass(slots=True)
class ResponsesRequest:
    chat: OpenAIRequest  # the same request as a chat completion
    body: ResponsesBody


def parse_responses_request(body: dict[str, Any]) -> ResponsesRequest:
    """Check a /v1/responses body and map it onto a chat request."""
    req = convert_body({k: v for k, v in body.items() if v is not None}, ResponsesBody)
    for name, bad in (
        ("previous_response_id", req.previous_response_id is not None),
        ("store", req.store is True),
        ("background", req.background is True),
        ("reasoning", req.reasoning is not None),
        ("conversation", req.conversation is not None),
        ("prompt", req.prompt is not None),
    ):
        if bad:
            raise HandlerError(
                f"{name}: not supported (this server is stateless: nothing is stored)"
                if name in ("previous_response_id", "store", "conversation")
                else f"{name}: not supported",
                param=name,
            )
    chat: dict[str, Any] = {
        "model": req.model,
        "messages": _messages(req),
        "stream": req.stream,
        "max_tokens": req.max_output_tokens,
        "temperature": req.temperature,
        "top_p": req.top_p,
        "priority": req.priority,
        "cache_salt": req.cache_salt,
    }
    fmt = req.text.format if req.text is not None else None
    if fmt is not None and fmt.type == "json_object":
        chat["response_format"] = {"type": "json_object"}
    elif fmt is not None and fmt.type == "json_schema":
        if fmt.schema is None:
            raise HandlerError("text.format.schema: required for json_schema", param="text.format.schema")
        chat["response_format"] = {"type": "json_schema", "json_schema": {"name": fmt.name, "schema": fmt.schema}}
    if req.tools:
        chat["tools"] = [
            {"type": "function", "function": {k: v for k, v in msgspec.to_builtins(t).items() if k != "type"}}
            for t in req.tools
        ]
        chat["tool_choice"] = _tool_choice(req.tool_choice)
        chat["parallel_tool_calls"] = req.parallel_tool_calls
    elif req.tool_choice not in (None, "none", "auto"):
        raise HandlerError("tool_choice: needs `tools`", param="tool_choice")
    return ResponsesRequest(parse_chat_request({k: v for k, v in chat.items() if v is not None}), req)


def _tool_choice(choice: Any) -> Any:
    if isinstance(choice, dict) and choice.get("type") == "function" and "name" in choice:
        return {"type": "function", "function": {"name": choice["name"]}}  # Responses' flat form
    return choice


def _messages(req: ResponsesBody) -> list[dict[str, Any]]:
    """`instructions` + `input` -> chat messages (function calls and their outputs included)."""
    messages: list[dict[str, Any]] = []
    if req.instructions:
        messages.append({"role": "system", "content": req.instructions})
    if isinstance(req.input, str):
        return [*messages, {"role": "user", "content": req.input}]
    for i, item in enumerate(req.input):
        kind = item.get("type", "message")
        if kind == "message":
            content = item.get("content")
            if isinstance(content, list):
                content = [
                    {"type": "text", "text": part.get("text")}
                    if part.get("type") in ("input_text", "output_text", "text")
                    else part
                    for part in content
                ]
            messages.append({"role": item.get("role"), "content": content})
        elif kind == "function_call":
            messages.append(
                {
                    "role": "assistant",
                    "tool_calls": [
                        {
                            "id": item.get("call_id"),
                            "type": "function",
                            "function": {"name": item.get("name"), "arguments": item.get("arguments")},
                        }
                    ],
                }
            )
        elif kind == "function_call_output":
            messages.append({"role": "tool", "tool_call_id": item.get("call_id"), "content": item.get("output")})
        else:
            raise HandlerError(
                f"input[{i}].type: {kind!r} is not supported (message, function_call, function_call_output)",
                param=f"input[{i}].type",
            )
    return messages


@dataclass(slots=True)
class ResponsesShaper:
    """A `pagedserve.server.serving.generation.Shaper` for /v1/responses: the response object, or its events."""

    request: ResponsesRequest
    response_id: str
    model: str
    created: int
    tool_parser: ToolParser = ToolParser.HERMES
    stream_format: Any = None  # pagedserve.server.serving.streaming.StreamFormat.SSE, set by the route
    _seq: int = 0
    _text: str = ""
    _message_id: str = field(default_factory=lambda: "msg_" + uuid.uuid4().hex)

    # -- whole -------------------------------------------------------------------------------
    def whole(self, out: RequestOutput, total_s: float) -> dict[str, Any]:
        c = out.outputs[0]
        body = self._response(self._output(c.text), c.finish_reason, usage=_usage(out))
        body["timings"] = timings(out, total_s)
        return body

    # -- stream ------------------------------------------------------------------------------
    def opening(self, n: int) -> list[dict[str, Any]]:
        events = [
            self._event("response.created", response=self._response([], None, status="in_progress")),
            self._event("response.in_progress", response=self._response([], None, status="in_progress")),
        ]
        if not self._holds():
            events += [
                self._event("response.output_item.added", output_index=0, item=self._message("", "in_progress")),
                self._event(
                    "response.content_part.added",
                    output_index=0,
                    item_id=self._message_id,
                    content_index=0,
                    part=_part(""),
                ),
            ]
        return events

    def chunk(self, deltas: list[ChoiceDelta]) -> list[dict[str, Any]]:
        text = "".join(d.text for d in deltas)
        self._text += text
        if self._holds() or not text:
            return []
        return [
            self._event(
                "response.output_text.delta",
                output_index=0,
                item_id=self._message_id,
                content_index=0,
                delta=text,
                logprobs=[],
            )
        ]

    def closing(self, deltas: list[ChoiceDelta], out: RequestOutput, total_s: float) -> list[dict[str, Any]]:
        events = self.chunk(deltas)
        c = out.outputs[0]
        output = self._output(self._text)
        if self._holds():
            for i, item in enumerate(output):
                events.append(
                    self._event("response.output_item.added", output_index=i, item={**item, "status": "in_progress"})
                )
                if item["type"] == "function_call":
                    events += [
                        self._event(
                            "response.function_call_arguments.delta",
                            output_index=i,
                            item_id=item["id"],
                            delta=item["arguments"],
                        ),
                        self._event(
                            "response.function_call_arguments.done",
                            output_index=i,
                            item_id=item["id"],
                            arguments=item["arguments"],
                        ),
                    ]
                else:
                    events += self._text_done(i, item["content"][0]["text"], with_delta=True)
                events.append(self._event("response.output_item.done", output_index=i, item=item))
        else:
            events += self._text_done(0, self._text)
            events.append(self._event("response.output_item.done", output_index=0, item=output[0]))
        final = self._response(output, c.finish_reason, usage=_usage(out))
        kind = "response.incomplete" if final["status"] == "incomplete" else "response.completed"
        events.append(self._event(kind, response=final))
        events[-1]["timings"] = timings(out, total_s)
        return events

    def error(self, code: int, message: str) -> dict[str, Any]:
        return self._event("error", code=str(code), message=message, param=None)

    # -- helpers -----------------------------------------------------------------------------
    def _holds(self) -> bool:
        return self.request.chat.tools is not None

    def _text_done(self, i: int, text: str, *, with_delta: bool = False) -> list[dict[str, Any]]:
        ids = {"output_index": i, "item_id": self._message_id, "content_index": 0}
        events = [self._event("response.content_part.added", **ids, part=_part(""))] if with_delta else []
        if with_delta and text:
            events.append(self._event("response.output_text.delta", **ids, delta=text, logprobs=[]))
        return events + [
            self._event("response.output_text.done", **ids, text=text, logprobs=[]),
            self._event("response.content_part.done", **ids, part=_part(text)),
        ]

    def _output(self, text: str) -> list[dict[str, Any]]:
        tools = self.request.chat.tools
        if tools is None:
            return [self._message(text, "completed")]
        parsed = parse_output(text, tools, self.tool_parser)
        items = [self._message(parsed.content, "completed")] if parsed.content else []
        return items + [
            {
                "type": "function_call",
                "id": "fc_" + call.id.removeprefix("call_"),
                "call_id": call.id,
                "name": call.name,
                "arguments": call.arguments,
                "status": "completed",
            }
            for call in parsed.calls
        ]

    def _message(self, text: str, status: str) -> dict[str, Any]:
        return {
            "type": "message",
            "id": self._message_id,
            "status": status,
            "role": "assistant",
            "content": [_part(text)] if status == "completed" else [],
        }

    def _response(
        self,
        output: list[dict[str, Any]],
        finish_reason: FinishReason | None,
        *,
        status: str | None = None,
        usage: dict[str, Any] | None = None,
    ) -> dict[str, Any]:
        body = self.request.body
        if status is None:
            status = "incomplete" if finish_reason == FinishReason.LENGTH else "completed"
        return {
            "id": self.response_id,
            "object": "response",
            "created_at": self.created,
            "status": status,
            "model": self.model,
            "output": output,
            "error": None,
            "incomplete_details": {"reason": "max_output_tokens"} if status == "incomplete" else None,
            "instructions": body.instructions,
            "max_output_tokens": body.max_output_tokens,
            "temperature": self.request.chat.params.temperature,
            "top_p": self.request.chat.params.top_p,
            "tools": [msgspec.to_builtins(t) for t in body.tools or ()],
            "tool_choice": body.tool_choice if body.tool_choice is not None else "auto",
            "parallel_tool_calls": body.parallel_tool_calls is not False,
            "text": {
                "format": msgspec.to_builtins(body.text.format) if body.text and body.text.format else {"type": "text"}
            },
            "metadata": body.metadata or {},
            "store": False,
            "previous_response_id": None,
            "truncation": "disabled",
            "usage": usage,
        }

    def _event(self, kind: str, **fields: Any) -> dict[str, Any]:
        self._seq += 1
        return {"type": kind, "sequence_number": self._seq - 1, **fields}


def _part(text: str) -> dict[str, Any]:
    return {"type": "output_text", "text": text, "annotations": [], "logprobs": []}


def _usage(out: RequestOutput) -> dict[str, Any]:
    prompt, completion = len(out.prompt_token_ids), sum(len(c.token_ids) for c in out.outputs)
    return {
        "input_tokens": prompt,
        "input_tokens_details": {"cached_tokens": out.num_cached_tokens},
        "output_tokens": completion,
        "output_tokens_details": {"reasoning_tokens": 0},
        "total_tokens": prompt + completion,
    }
