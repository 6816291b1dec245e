"""Request bodies -> engine inputs, without an engine: the parsing half of the `llm` handler,
shared by the in-process handler and the server's inference routes.

Parsing is split in two so the server can do the cheap checks on the event loop and the
tokenization (chat templates included) in a thread: `parse_predictions_body` converts the body
to its declared schema (`PredictionsBody` for the prompt, `SamplingParams` for the rest);
`render_prompt` tokenizes; `check_fits` applies the length rules. Every refusal is a
`HandlerError` (HTTP 400 by default) whose message and `param` name the field.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Annotated, Any, Literal

import jinja2
import msgspec

from engine.sampling_params import SamplingParams, TokenId
from engine.schema import SchemaError, convert
from handlers.base_handler import HandlerError
from handlers.json_body import decode_json_body

TokenIds = Annotated[list[TokenId], msgspec.Meta(min_length=1)]


class ChatMessage(msgspec.Struct, forbid_unknown_fields=True):
    """One chat message (OpenAI's shape). `content` is a string or a list of text parts;
    other parts (images, audio) are refused by `message_text`."""

    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[dict[str, Any]]
    name: str | None = None
    tool_call_id: str | None = None


ChatMessages = Annotated[list[ChatMessage], msgspec.Meta(min_length=1)]


class PredictionsBody(msgspec.Struct, forbid_unknown_fields=True):
    """A /predictions body besides its sampling fields (those are SamplingParams')."""

    prompt: str | TokenIds | None = None
    messages: ChatMessages | None = None
    stream: bool = False
    model: str | None = None  # accepted and ignored: the route names the model


PREDICTIONS_FIELDS = frozenset(f.name for f in msgspec.structs.fields(PredictionsBody))


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


def decode_body(raw: Any, max_bytes: int | None = None) -> dict[str, Any]:
    """Bytes, text or an already decoded object -> a JSON object (handlers.json_body)."""
    return decode_json_body(raw, max_bytes)


def convert_body(data: Any, schema: type[Any]) -> Any:
    """`engine.schema.convert` with a HandlerError (400, `param` = the field) on refusal."""
    try:
        return convert(data, schema)
    except SchemaError as exc:
        raise HandlerError(str(exc), param=exc.field) from None


def make_sampling_params(fields: dict[str, Any]) -> SamplingParams:
    """SamplingParams from request fields; a bad value becomes a HandlerError naming it."""
    return convert_body(fields, SamplingParams)


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


def chat_messages(messages: list[ChatMessage]) -> list[dict[str, str]]:
    """Checked messages -> what the chat template reads: {role, content} with the content
    flattened to one string ("developer" is "system" to the template)."""
    return [{"role": "system" if m.role == "developer" else m.role, "content": message_text(m.content, i)}
            for i, m in enumerate(messages)]


def message_text(content: str | list[dict[str, Any]], i: int) -> str:
    if isinstance(content, str):
        return content
    texts = []
    for j, part in enumerate(content):
        if part.get("type") != "text" or not isinstance(part.get("text"), str):
            raise HandlerError(f"messages[{i}].content[{j}]: only text parts are supported, got "
                               f"{part.get('type')!r}", param=f"messages[{i}].content")
        texts.append(part["text"])
    return "".join(texts)


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
