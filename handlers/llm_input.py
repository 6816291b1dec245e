"""Request bodies -> engine inputs, without an engine: the parsing half of the `llm` handler,
shared by the in-process handler and the server's inference routes.

Parsing is split in two so the server can do the cheap checks on the event loop and the
tokenization (chat templates included) in a thread: `parse_predictions_body` checks fields and
builds `SamplingParams`; `render_prompt` tokenizes; `check_fits` applies the length rules.
Every refusal is a `HandlerError` (HTTP 400 by default) whose message names the field.
"""

from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass
from typing import Any

import jinja2

from engine.sampling_params import SamplingParams
from handlers.base_handler import HandlerError

SAMPLING_FIELDS = frozenset(f.name for f in dataclasses.fields(SamplingParams))
PROMPT_FIELDS = frozenset({"prompt", "messages"})
# Accepted and ignored: routing fields the server or the client sets.
IGNORED_FIELDS = frozenset({"model"})
TRANSPORT_FIELDS = frozenset({"stream"})
CHAT_ROLES = frozenset({"system", "developer", "user", "assistant", "tool"})


@dataclass(slots=True)
class PromptSpec:
    """What to tokenize: exactly one of text, token ids or chat messages."""

    text: str | None = None
    token_ids: list[int] | None = None
    messages: list[dict[str, str]] | None = None
    add_generation_prompt: bool = True

    def __post_init__(self) -> None:
        given = sum(x is not None for x in (self.text, self.token_ids, self.messages))
        if given != 1:
            raise ValueError("a PromptSpec holds exactly one of text, token_ids or messages")


@dataclass(slots=True)
class ParsedBody:
    """A /predictions body after field checks: the prompt to render plus sampling params."""

    prompt: PromptSpec
    params: SamplingParams
    stream: bool = False


@dataclass(slots=True)
class LLMInput:
    """A request ready for the engine."""

    prompt: str | None  # the text the token ids came from (None for a token-id prompt)
    token_ids: list[int]
    params: SamplingParams


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


def render_prompt(tokenizer: Any, spec: PromptSpec) -> tuple[str | None, list[int]]:
    """Tokenize a prompt (chat messages through the model's chat template): (text, token ids).
    CPU-bound: the server runs it in a thread."""
    if spec.token_ids is not None:
        return None, list(spec.token_ids)
    if spec.messages is not None:
        try:
            text = tokenizer.apply_chat_template(
                spec.messages, tokenize=False, add_generation_prompt=spec.add_generation_prompt
            )
        except (jinja2.TemplateError, TypeError, ValueError, KeyError) as exc:  # templates raise their own
            raise HandlerError(f"the model's chat template refused the messages: {exc}") from None
    else:
        text = spec.text
    return text, tokenizer.encode(text, add_special_tokens=False)


def check_fits(token_ids: list[int], params: SamplingParams, max_model_len: int | None,
               vocab_size: int | None = None) -> None:
    """The length rules of an OpenAI-style server: a non-empty prompt shorter than max_model_len,
    and prompt + max_tokens within max_model_len; token ids inside the vocabulary."""
    if not token_ids:
        raise HandlerError("the prompt must contain at least one token")
    if vocab_size is not None:
        bad = [t for t in token_ids if not 0 <= t < vocab_size]
        if bad:
            raise HandlerError(f"token ids out of range [0, {vocab_size}): {bad[:5]}")
    if max_model_len is None:
        return
    if len(token_ids) >= max_model_len:
        raise HandlerError(
            f"the prompt has {len(token_ids)} tokens but max_model_len is {max_model_len}: "
            f"at most {max_model_len - 1} prompt tokens fit"
        )
    if params.max_tokens is not None and len(token_ids) + params.max_tokens > max_model_len:
        raise HandlerError(
            f"max_tokens={params.max_tokens} is too large: the prompt has {len(token_ids)} tokens "
            f"and max_model_len is {max_model_len}, so at most {max_model_len - len(token_ids)} "
            "tokens can be generated"
        )
