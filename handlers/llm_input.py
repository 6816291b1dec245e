"""Request bodies -> what to prepare, without an engine: the parsing half of the `llm` handler.

`parse_predictions_body` converts a /predictions body to its declared schema (`PredictionsBody`
for the prompt, `SamplingParams` for the rest) on the event loop and returns a `PromptSpec`
(re-exported here for custom handlers) with the params; the prepare step that follows
(tokenize, chat template, length rules) is the engine's, pagedserve.engine.request.inputs. Every refusal is a
`HandlerError` (HTTP 400 by default) whose message and `param` name the field.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Annotated, Any, Literal

import msgspec

from pagedserve.engine.config.schema import SchemaError, convert
from pagedserve.engine.request.inputs import PromptSpec
from pagedserve.engine.sampling.params import SamplingParams, TokenId
from pagedserve.handlers.errors import HandlerError
from pagedserve.handlers.json_body import decode_json_body

TokenIds = Annotated[list[TokenId], msgspec.Meta(min_length=1)]


class CalledFunction(msgspec.Struct, forbid_unknown_fields=True):
    name: str
    arguments: str  # JSON text, as OpenAI sends it


class AssistantToolCall(msgspec.Struct, forbid_unknown_fields=True):
    id: str
    type: Literal["function"]
    function: CalledFunction


class ChatMessage(msgspec.Struct, forbid_unknown_fields=True):
    """One chat message (OpenAI's shape). `content` is a string or a list of text parts;
    other parts (images, audio) are refused by `message_text`. An assistant message may carry
    `tool_calls` instead of content; a `tool` message answers one by `tool_call_id`."""

    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[dict[str, Any]] | None = None
    name: str | None = None
    tool_call_id: str | None = None
    tool_calls: list[AssistantToolCall] | None = None
    refusal: str | None = None


ChatMessages = Annotated[list[ChatMessage], msgspec.Meta(min_length=1)]


class PredictionsBody(msgspec.Struct, forbid_unknown_fields=True):
    """A /predictions body besides its sampling fields (those are SamplingParams')."""

    prompt: str | TokenIds | None = None
    messages: ChatMessages | None = None
    stream: bool = False
    model: str | None = None  # accepted and ignored: the route names the model


PREDICTIONS_FIELDS = frozenset(f.name for f in msgspec.structs.fields(PredictionsBody))


@dataclass(slots=True)
class ParsedBody:
    """A /predictions body after field checks: the prompt to render plus sampling params."""

    prompt: PromptSpec
    params: SamplingParams
    stream: bool = False


def decode_body(raw: Any, max_bytes: int | None = None) -> dict[str, Any]:
    """Bytes, text or an already decoded object -> a JSON object (pagedserve.handlers.json_body)."""
    return decode_json_body(raw, max_bytes)


def convert_body(data: Any, schema: type[Any]) -> Any:
    """`pagedserve.engine.config.schema.convert` with a HandlerError (400, `param` = the field) on refusal."""
    try:
        return convert(data, schema)
    except SchemaError as exc:
        raise HandlerError(str(exc), param=exc.field) from None


def make_sampling_params(fields: dict[str, Any]) -> SamplingParams:
    """SamplingParams from request fields; a bad value becomes a HandlerError naming it.
    `logit_bias` keys arrive as JSON object keys (strings) and are read as token ids."""
    bias = fields.get("logit_bias")
    if isinstance(bias, dict):
        fields = {**fields, "logit_bias": {_token_id_key(key): value for key, value in bias.items()}}
    return convert_body(fields, SamplingParams)


def rename_max_new_tokens(fields: dict[str, Any]) -> dict[str, Any]:
    """TorchServe LLM examples' `max_new_tokens` (also KServe's parameters) -> `max_tokens`."""
    if "max_new_tokens" not in fields:
        return fields
    if "max_tokens" in fields:
        raise HandlerError(
            "max_new_tokens: give it or 'max_tokens' (the same setting), not both", param="max_new_tokens"
        )
    fields = dict(fields)
    fields["max_tokens"] = fields.pop("max_new_tokens")
    return fields


def _token_id_key(key: Any) -> Any:
    if isinstance(key, str):
        if not key.isascii() or not key.isdigit():
            raise HandlerError(
                f"logit_bias: keys must be token ids (non-negative integers), got {key!r}", param="logit_bias"
            )
        return int(key)
    return key


def parse_predictions_body(body: dict[str, Any]) -> ParsedBody:
    """Check a /predictions body: `prompt` (text or token ids) or `messages`, sampling fields
    named as in SamplingParams, optional `stream`. Unknown fields are refused."""
    parsed = convert_body({k: v for k, v in body.items() if k in PREDICTIONS_FIELDS}, PredictionsBody)
    params = make_sampling_params({k: v for k, v in body.items() if k not in PREDICTIONS_FIELDS})
    if (parsed.prompt is None) == (parsed.messages is None):
        raise HandlerError("give exactly one of 'prompt' or 'messages'")
    if parsed.messages is not None:
        prompt = PromptSpec(messages=chat_messages(parsed.messages))
    elif isinstance(parsed.prompt, str):
        prompt = PromptSpec(text=parsed.prompt)
    else:
        prompt = PromptSpec(token_ids=parsed.prompt)
    return ParsedBody(prompt, params, parsed.stream)


def chat_messages(messages: list[ChatMessage]) -> list[dict[str, Any]]:
    """Checked messages -> what the chat template reads: {role, content} with the content
    flattened to one string ("developer" is "system" to the template); assistant `tool_calls`
    (arguments as objects, as Hugging Face templates read them) and a tool's `tool_call_id`."""
    out: list[dict[str, Any]] = []
    for i, m in enumerate(messages):
        if m.content is None and not (m.role == "assistant" and m.tool_calls):
            raise HandlerError(f"messages[{i}].content: required", param=f"messages[{i}].content")
        if m.tool_calls and m.role != "assistant":
            raise HandlerError(
                f"messages[{i}].tool_calls: only assistant messages have tool calls", param=f"messages[{i}].tool_calls"
            )
        entry: dict[str, Any] = {
            "role": "system" if m.role == "developer" else m.role,
            "content": message_text(m.content, i),
        }
        if m.tool_calls:
            entry["tool_calls"] = [
                {
                    "id": c.id,
                    "type": "function",
                    "function": {"name": c.function.name, "arguments": _arguments(c.function.arguments, i)},
                }
                for c in m.tool_calls
            ]
        if m.tool_call_id is not None:
            entry["tool_call_id"] = m.tool_call_id
        out.append(entry)
    return out


def _arguments(text: str, i: int) -> Any:
    try:
        return json.loads(text)
    except ValueError:
        raise HandlerError(
            f"messages[{i}].tool_calls: arguments must be JSON text, got {text[:80]!r}",
            param=f"messages[{i}].tool_calls",
        ) from None


def message_text(content: str | list[dict[str, Any]] | None, i: int) -> str:
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    texts = []
    for j, part in enumerate(content):
        if part.get("type") != "text" or not isinstance(part.get("text"), str):
            raise HandlerError(
                f"messages[{i}].content[{j}]: only text parts are supported, got {part.get('type')!r}",
                param=f"messages[{i}].content",
            )
        texts.append(part["text"])
    return "".join(texts)
