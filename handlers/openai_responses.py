"""Engine outputs -> OpenAI response bodies and stream chunks (completions and chat), with
`usage` (cached prompt tokens in `prompt_tokens_details`) and pagedserve's `timings`.

A chat request with tools has its calls read out of each finished choice (pagedserve.handlers.openai_tools):
the message gets `tool_calls` and the finish_reason `tool_calls`. Streamed, such a choice's text
is held until it finishes (a call cannot be told from text before then); then it is sent as
OpenAI streams calls: the content, if any, then per call a `tool_calls` delta with the call's
`index`, `id`, `type` and function `name` (arguments ""), then deltas that carry fragments of
its `arguments` (split after each comma), and last an empty delta with the finish_reason. The
SDKs reassemble the fragments into the call."""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from typing import Any

from pagedserve.engine.request.outputs import FinishReason, RequestOutput, TokenLogprob
from pagedserve.handlers.deltas import ChoiceDelta
from pagedserve.handlers.llm_output import timings, usage
from pagedserve.handlers.openai_protocol import Endpoint, OpenAIRequest
from pagedserve.handlers.openai_tools import ToolParser, parse_output


def openai_usage(out: RequestOutput) -> dict[str, Any]:
    """`usage` as OpenAI names it: cached prompt tokens under `prompt_tokens_details`."""
    record = usage(out)
    record["prompt_tokens_details"] = {"cached_tokens": record.pop("cached_prompt_tokens")}
    return record


@dataclass(slots=True)
class OpenAIFormatter:
    """Shapes one request's answer: whole (`response`) or as stream chunks. Choice `index`
    i * n + j is prompt i's choice j; with `echo`, each choice's text starts with its prompt's
    text (`prompt_texts`, one per prompt; streamed: in the choice's first chunk)."""

    request: OpenAIRequest
    response_id: str
    model: str  # the name the client asked for
    created: int
    prompt_texts: list[str] = field(default_factory=list)
    tool_parser: ToolParser = ToolParser.HERMES  # the model's (model-config toolParser)
    _echoed: set[int] = field(default_factory=set)  # choices whose stream has sent the prompt
    _held: dict[int, str] = field(default_factory=dict)  # streamed tool-call text per choice

    @property
    def is_chat(self) -> bool:
        return self.request.endpoint is Endpoint.CHAT

    # -- whole responses ---------------------------------------------------------------------
    def response(self, out: RequestOutput, total_s: float | None = None) -> dict[str, Any]:
        choices = []
        for c in out.outputs:
            logprobs = self._logprobs(c.logprobs, 0) if self.request.logprobs else None
            if self.is_chat:
                message, finish_reason = self._message(c.text, c.finish_reason)
                choices.append(
                    {
                        "index": c.index,
                        "message": {"role": "assistant", **message},
                        "logprobs": logprobs,
                        "finish_reason": finish_reason,
                    }
                )
            else:
                choices.append(
                    {
                        "index": c.index,
                        "text": self._echo(c.index) + c.text,
                        "logprobs": logprobs,
                        "finish_reason": c.finish_reason,
                    }
                )
        return {
            "id": self.response_id,
            "object": "chat.completion" if self.is_chat else "text_completion",
            "created": self.created,
            "model": self.model,
            "choices": choices,
            "usage": openai_usage(out),
            "timings": timings(out, total_s),
        }

    # -- streams -----------------------------------------------------------------------------
    def first_chunk(self, n: int) -> dict[str, Any] | None:
        """Chat streams open with the assistant role for every choice (as OpenAI does)."""
        if not self.is_chat:
            return None
        return self.chunk(
            [
                {"index": i, "delta": {"role": "assistant", "content": ""}, "logprobs": None, "finish_reason": None}
                for i in range(n)
            ]
        )

    def delta_chunks(self, deltas: list[ChoiceDelta]) -> list[dict[str, Any]]:
        """The chunks of what the choices gained: one chunk for every choice's new text (none
        when no choice has any), then the chunks of each finished choice with tools."""
        choices, tool_chunks = [], []
        for d in deltas:
            logprobs = self._logprobs(d.logprobs, d.text_offset) if self.request.logprobs and d.logprobs else None
            if self.is_chat and self.request.tools is not None:
                text = self._held.get(d.index, "") + d.text
                self._held[d.index] = text
                if d.finish_reason is not None:  # the whole choice is known: its content and calls
                    tool_chunks += self._tool_chunks(d.index, text, d.finish_reason)
            elif self.is_chat:
                delta = {"content": d.text} if d.text or d.finish_reason is None else {}
                choices.append(
                    {"index": d.index, "delta": delta, "logprobs": logprobs, "finish_reason": d.finish_reason}
                )
            else:
                echo = "" if d.index in self._echoed else self._echo(d.index)
                self._echoed.add(d.index)
                choices.append(
                    {"index": d.index, "text": echo + d.text, "logprobs": logprobs, "finish_reason": d.finish_reason}
                )
        return ([self.chunk(choices)] if choices else []) + tool_chunks

    def _tool_chunks(self, index: int, text: str, finish_reason: FinishReason) -> list[dict[str, Any]]:
        """A finished choice with tools, streamed as OpenAI streams calls (module docstring)."""
        message, finish = self._message(text, finish_reason)
        deltas: list[dict[str, Any]] = [{"content": message["content"]}] if message["content"] else []
        for i, call in enumerate(message.get("tool_calls", ())):
            function = call["function"]
            deltas.append(
                {
                    "tool_calls": [
                        {
                            "index": i,
                            "id": call["id"],
                            "type": "function",
                            "function": {"name": function["name"], "arguments": ""},
                        }
                    ]
                }
            )
            deltas += [
                {"tool_calls": [{"index": i, "function": {"arguments": piece}}]}
                for piece in _ARGUMENT_PIECES.findall(function["arguments"])
            ]
        return [
            self.chunk([{"index": index, "delta": delta, "logprobs": None, "finish_reason": None}]) for delta in deltas
        ] + [self.chunk([{"index": index, "delta": {}, "logprobs": None, "finish_reason": finish}])]

    def usage_chunk(self, out: RequestOutput) -> dict[str, Any]:
        """The closing chunk of `stream_options.include_usage`: no choices, the usage."""
        chunk = self.chunk([])
        chunk["usage"] = openai_usage(out)
        return chunk

    def chunk(self, choices: list[dict[str, Any]]) -> dict[str, Any]:
        chunk = {
            "id": self.response_id,
            "object": "chat.completion.chunk" if self.is_chat else "text_completion",
            "created": self.created,
            "model": self.model,
            "choices": choices,
        }
        if self.request.include_usage:
            chunk["usage"] = None  # OpenAI sends null on every chunk but the usage chunk
        return chunk

    def _message(self, text: str, finish_reason: FinishReason | None) -> tuple[dict[str, Any], str | None]:
        """A chat choice's message fields (content, tool_calls) and its finish_reason."""
        tools = self.request.tools
        if tools is None:
            return {"content": text}, finish_reason
        parsed = parse_output(text, tools, self.tool_parser)
        if not parsed.calls:
            return {"content": parsed.content}, finish_reason
        calls = [call.as_openai() for call in parsed.calls]
        ended = finish_reason == "stop" or tools.forced  # a forced list cut short keeps its complete calls
        return {"content": parsed.content, "tool_calls": calls}, "tool_calls" if ended else finish_reason

    def _echo(self, index: int) -> str:
        """The prompt text choice `index` starts with ("" without echo)."""
        if not self.request.echo:
            return ""
        return self.prompt_texts[index // self.request.params.n]

    # -- logprobs ----------------------------------------------------------------------------
    def _logprobs(self, entries: list[dict[int, TokenLogprob]] | None, text_offset: int) -> dict[str, Any] | None:
        if entries is None:
            return None
        k = self.request.top_logprobs
        if self.is_chat:
            return {"content": [_chat_token(entry, k) for entry in entries], "refusal": None}
        tokens, token_logprobs, top, offsets = [], [], [], []
        for entry in entries:
            sampled = next(iter(entry.values()))  # the sampled token comes first
            tokens.append(sampled.decoded_token)
            token_logprobs.append(sampled.logprob)
            top.append({lp.decoded_token: lp.logprob for lp in _top(entry, k)} if k else None)
            offsets.append(text_offset)
            text_offset += len(sampled.decoded_token)
        return {"tokens": tokens, "token_logprobs": token_logprobs, "top_logprobs": top, "text_offset": offsets}


_ARGUMENT_PIECES = re.compile(r"[^,]*,|[^,]+")  # a call's arguments, split after each comma


def _top(entry: dict[int, TokenLogprob], k: int) -> list[TokenLogprob]:
    """The k most likely alternatives, by rank."""
    return sorted(entry.values(), key=lambda lp: lp.rank)[:k]


def _chat_token(entry: dict[int, TokenLogprob], k: int) -> dict[str, Any]:
    sampled = next(iter(entry.values()))
    return {
        "token": sampled.decoded_token,
        "logprob": sampled.logprob,
        "bytes": list(sampled.decoded_token.encode("utf-8")),
        "top_logprobs": [
            {"token": lp.decoded_token, "logprob": lp.logprob, "bytes": list(lp.decoded_token.encode("utf-8"))}
            for lp in _top(entry, k)
        ],
    }
