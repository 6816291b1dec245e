"""Ollama's request bodies, declared once as msgspec Structs, and what they become: a prompt
to prepare and SamplingParams.

As Ollama does, fields a body does not know are ignored, and so are `options` this server has
no use for (`num_gpu`, `num_thread`, `mirostat`, ...); a known field of the wrong type, or a
value out of bounds, is a 400 naming it. `options` map onto SamplingParams: `num_predict`
(max_tokens; -1 or -2: the model's default limit), `temperature`, `top_k`, `top_p`, `min_p`,
`seed`, `stop`, `repeat_penalty` (repetition_penalty), `presence_penalty`,
`frequency_penalty`; `num_ctx` must not exceed the model's context length (checked by the
route, which knows it). `format` is `"json"` (any JSON object) or a JSON schema, enforced by
the grammar engine. `images` and `think` are refused: the models served here read text only.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Annotated, Any, Literal

import msgspec
from msgspec import Meta

from pagedserve.engine.request.inputs import PromptSpec
from pagedserve.engine.sampling.params import SamplingParams
from pagedserve.engine.structured_output.params import StructuredOutputsParams
from pagedserve.handlers.base_handler import HandlerError
from pagedserve.handlers.llm_input import convert_body, make_sampling_params
from pagedserve.handlers.openai_tools import ToolDef, ToolRequest

_Name = Annotated[str, Meta(min_length=1)]


class Options(msgspec.Struct):
    """The `options` this server honours (unknown ones are ignored, as Ollama does)."""

    num_predict: int | None = None
    num_ctx: Annotated[int, Meta(ge=1)] | None = None
    temperature: float | None = None
    top_k: int | None = None
    top_p: float | None = None
    min_p: float | None = None
    seed: int | None = None
    stop: str | list[str] | None = None
    repeat_penalty: float | None = None
    presence_penalty: float | None = None
    frequency_penalty: float | None = None


_SAMPLING_NAMES = {"repeat_penalty": "repetition_penalty"}  # Ollama's name -> SamplingParams'


class CalledFunction(msgspec.Struct):
    name: _Name
    arguments: dict[str, Any] | str = {}


class MessageToolCall(msgspec.Struct):
    function: CalledFunction
    id: str | None = None


class Message(msgspec.Struct):
    role: Literal["system", "user", "assistant", "tool"]
    content: str = ""
    images: list[str] | None = None
    tool_calls: list[MessageToolCall] | None = None
    tool_name: str | None = None
    tool_call_id: str | None = None
    thinking: str | None = None


Format = Literal["", "json"] | dict[str, Any]


class _Body(msgspec.Struct, kw_only=True):
    model: _Name
    stream: bool = True
    format: Format | None = None
    options: Options | None = None
    think: bool | str | None = None


class GenerateBody(_Body, kw_only=True):
    prompt: str = ""
    suffix: str | None = None
    system: str | None = None
    template: str | None = None
    context: list[int] | None = None
    raw: bool = False
    images: list[str] | None = None


class ChatBody(_Body, kw_only=True):
    messages: list[Message] = []
    tools: Annotated[list[ToolDef], Meta(max_length=128)] | None = None


class EmbedBody(msgspec.Struct, kw_only=True):
    model: _Name
    input: str | Annotated[list[str], Meta(min_length=1, max_length=2048)] = ""
    truncate: bool = True
    options: Options | None = None
    dimensions: int | None = None


class EmbeddingsBody(msgspec.Struct, kw_only=True):
    """The older /api/embeddings: one `prompt`, one `embedding`."""

    model: _Name
    prompt: str = ""
    options: Options | None = None


class ModelBody(msgspec.Struct, kw_only=True):
    """/api/show, /api/delete, /api/pull (`model`, or the older `name`)."""

    model: str | None = None
    name: str | None = None

    @property
    def asked(self) -> str:
        given = self.model or self.name
        if not given:
            raise HandlerError("model: required", param="model")
        return given


@dataclass(slots=True)
class OllamaRequest:
    """A checked /api/generate or /api/chat body: what to prepare and how to sample."""

    model: str
    prompt: PromptSpec | None  # None: an empty /api/generate prompt (load or unload only)
    params: SamplingParams
    stream: bool
    num_ctx: int | None
    tools: ToolRequest | None = None


def decode(body: dict[str, Any], schema: type) -> Any:
    """The body as its Struct; a 400 naming the field otherwise."""
    return convert_body(body, schema)


def parse_generate(body: dict[str, Any]) -> OllamaRequest:
    req = decode(body, GenerateBody)
    _refuse(bool(req.images), "images", "images are not supported: the models served here read text only")
    _refuse(bool(req.suffix), "suffix", "not supported (no fill-in-the-middle template)")
    _refuse(bool(req.template), "template", "not supported: the model's own chat template is used")
    _refuse(bool(req.context), "context", "not supported (deprecated by Ollama): send the history with /api/chat")
    _check_think(req.think)
    if not req.prompt:
        prompt = None
    elif req.raw:
        prompt = PromptSpec(text=req.prompt)
    else:
        messages = ([{"role": "system", "content": req.system}] if req.system else []) + [
            {"role": "user", "content": req.prompt}
        ]
        prompt = PromptSpec(messages=messages)
    return OllamaRequest(
        req.model,
        prompt,
        sampling_params(req.options, req.format),
        req.stream,
        req.options.num_ctx if req.options else None,
    )


def parse_chat(body: dict[str, Any]) -> OllamaRequest:
    req = decode(body, ChatBody)
    _check_think(req.think)
    _refuse(not req.messages, "messages", "at least one message is required")
    tools = ToolRequest(list(req.tools), "auto") if req.tools else None
    _refuse(
        tools is not None and isinstance(req.format, dict) or (tools is not None and req.format == "json"),
        "format",
        "cannot be combined with tools",
    )
    messages = [_message(m, i) for i, m in enumerate(req.messages)]
    return OllamaRequest(
        req.model,
        PromptSpec(messages=messages),
        sampling_params(req.options, req.format),
        req.stream,
        req.options.num_ctx if req.options else None,
        tools,
    )


def _message(m: Message, i: int) -> dict[str, Any]:
    """An Ollama message -> the chat template's shape (pagedserve.handlers.openai_tools renders tool turns)."""
    _refuse(bool(m.images), f"messages[{i}].images", "images are not supported: the models served here read text only")
    entry: dict[str, Any] = {"role": m.role, "content": m.content}
    if m.tool_calls:
        _refuse(m.role != "assistant", f"messages[{i}].tool_calls", "only assistant messages have tool calls")
        entry["tool_calls"] = [
            {
                "id": c.id or f"call_{i}_{j}",
                "type": "function",
                "function": {
                    "name": c.function.name,
                    "arguments": _arguments(c.function.arguments, f"messages[{i}].tool_calls[{j}]"),
                },
            }
            for j, c in enumerate(m.tool_calls)
        ]
    if m.role == "tool" and (m.tool_call_id or m.tool_name):
        entry["tool_call_id"] = m.tool_call_id or m.tool_name
    return entry


def _arguments(arguments: dict[str, Any] | str, field: str) -> dict[str, Any]:
    if isinstance(arguments, dict):
        return arguments
    try:
        parsed = json.loads(arguments)
    except ValueError:
        parsed = None
    _refuse(not isinstance(parsed, dict), f"{field}.function.arguments", "must be an object (or its JSON text)")
    return parsed


def sampling_params(options: Options | None, fmt: Format | None) -> SamplingParams:
    """`options` and `format` -> SamplingParams (Ollama's defaults: no token limit given means
    the model's default_max_tokens)."""
    fields: dict[str, Any] = {"max_tokens": None, "temperature": 0.8}  # Ollama's default temperature
    if options is not None:
        for name, value in msgspec.structs.asdict(options).items():
            if value is None or name == "num_ctx":
                continue
            if name == "num_predict":
                _refuse(
                    value == 0 or value < -2,
                    "options.num_predict",
                    f"must be a positive number of tokens, or -1 / -2 for the model's default limit, got {value}",
                )
                value = value if value > 0 else None
                name = "max_tokens"
            fields[_SAMPLING_NAMES.get(name, name)] = value
    if fmt == "json":
        fields["structured_outputs"] = StructuredOutputsParams(json_object=True)
    elif isinstance(fmt, dict):
        fields["structured_outputs"] = convert_body({"json": fmt}, StructuredOutputsParams)
    try:
        return make_sampling_params(fields)
    except HandlerError as exc:  # name the field as the client wrote it
        if exc.param and exc.param not in ("structured_outputs",):
            inverse = {v: k for k, v in _SAMPLING_NAMES.items()}
            name = "num_predict" if exc.param == "max_tokens" else inverse.get(exc.param, exc.param)
            raise HandlerError(str(exc).replace(exc.param, f"options.{name}", 1), param=f"options.{name}") from None
        raise HandlerError(str(exc), param="format") from None


def _check_think(think: bool | str | None) -> None:
    _refuse(think not in (None, False), "think", "not supported: the models served here do not think aloud")


def _refuse(condition: bool, field: str, message: str) -> None:
    if condition:
        raise HandlerError(f"{field}: {message}", param=field)
