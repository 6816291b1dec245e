"""Request bodies -> what to prepare, without an engine: the parsing half of the `llm` handler.

`parse_predictions_body` checks a /predictions body's fields on the event loop and builds a
`PromptSpec` (re-exported here for custom handlers) and `SamplingParams`; the prepare step that
follows (tokenize, chat template, length rules) is the engine's, engine.inputs. Every refusal
is a `HandlerError` (HTTP 400 by default) whose message names the field.
"""

from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass
from typing import Any

from engine.inputs import PromptSpec
from engine.sampling_params import SamplingParams
from handlers.base_handler import HandlerError

SAMPLING_FIELDS = frozenset(f.name for f in dataclasses.fields(SamplingParams))
PROMPT_FIELDS = frozenset({"prompt", "messages"})
# Accepted and ignored: routing fields the server or the client sets.
IGNORED_FIELDS = frozenset({"model"})
TRANSPORT_FIELDS = frozenset({"stream"})
CHAT_ROLES = frozenset({"system", "developer", "user", "assistant", "tool"})


@dataclass(slots=True)
class ParsedBody:
    """A /predictions body after field checks: the prompt to render plus sampling params."""

    prompt: PromptSpec
    params: SamplingParams
    stream: bool = False


def decode_body(raw: Any) -> dict[str, Any]:
    """Bytes, text or an already decoded object -> a JSON object (dict), else HandlerError."""
    if isinstance(raw, (bytes, bytearray)):
        try:
            raw = raw.decode("utf-8")
        except UnicodeDecodeError:
            raise HandlerError("the request body is not UTF-8") from None
    if isinstance(raw, str):
        try:
            raw = json.loads(raw)
        except json.JSONDecodeError as exc:
            raise HandlerError(f"the request body is not valid JSON: {exc}") from None
    if not isinstance(raw, dict):
        raise HandlerError("the request body must be a JSON object")
    return raw


def make_sampling_params(fields: dict[str, Any]) -> SamplingParams:
    """SamplingParams from checked field names; a bad value becomes a HandlerError naming it."""
    try:
        return SamplingParams(**fields)
    except (ValueError, TypeError) as exc:
        raise HandlerError(str(exc)) from None


def parse_predictions_body(body: dict[str, Any]) -> ParsedBody:
    """Check a /predictions body: `prompt` (text or token ids) or `messages`, sampling fields
    named as in SamplingParams, optional `stream`. Unknown fields are refused."""
    unknown = set(body) - SAMPLING_FIELDS - PROMPT_FIELDS - IGNORED_FIELDS - TRANSPORT_FIELDS
    if unknown:
        raise HandlerError(f"unknown field(s) {sorted(unknown)}")
    if ("prompt" in body) == ("messages" in body):
        raise HandlerError("give exactly one of 'prompt' or 'messages'")
    stream = body.get("stream", False)
    if not isinstance(stream, bool):
        raise HandlerError(f"'stream' must be a boolean, got {stream!r}")
    params = make_sampling_params({k: v for k, v in body.items() if k in SAMPLING_FIELDS})
    if "messages" in body:
        prompt = PromptSpec(messages=check_messages(body["messages"]))
    else:
        prompt = prompt_spec(body["prompt"], "prompt")
    return ParsedBody(prompt, params, stream)


def prompt_spec(value: Any, name: str) -> PromptSpec:
    """A text prompt or a non-empty list of token ids."""
    if isinstance(value, str):
        return PromptSpec(text=value)
    if isinstance(value, list) and value and all(isinstance(t, int) and not isinstance(t, bool) for t in value):
        return PromptSpec(token_ids=list(value))
    raise HandlerError(f"'{name}' must be a string or a non-empty list of token ids")


def check_messages(messages: Any) -> list[dict[str, str]]:
    """A non-empty list of {role, content}; content is a string or a list of text parts
    (OpenAI's shape), flattened to one string. Other parts (images, audio) are refused."""
    if not isinstance(messages, list) or not messages:
        raise HandlerError("'messages' must be a non-empty list of {role, content} objects")
    checked = []
    for i, message in enumerate(messages):
        if not isinstance(message, dict):
            raise HandlerError(f"messages[{i}] must be an object with 'role' and 'content'")
        role, content = message.get("role"), message.get("content")
        if role not in CHAT_ROLES:
            raise HandlerError(f"messages[{i}].role must be one of {sorted(CHAT_ROLES)}, got {role!r}")
        unknown = set(message) - {"role", "content", "name", "tool_call_id"}
        if unknown:
            raise HandlerError(f"messages[{i}] has unsupported field(s) {sorted(unknown)}")
        checked.append({"role": "system" if role == "developer" else role,
                        "content": _message_text(content, i)})
    return checked


def _message_text(content: Any, i: int) -> str:
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        texts = []
        for part in content:
            if not isinstance(part, dict) or part.get("type") != "text" or not isinstance(part.get("text"), str):
                kind = part.get("type") if isinstance(part, dict) else type(part).__name__
                raise HandlerError(f"messages[{i}].content: only text parts are supported, got {kind!r}")
            texts.append(part["text"])
        return "".join(texts)
    raise HandlerError(f"messages[{i}].content must be a string or a list of text parts")
