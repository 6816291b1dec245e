"""Anthropic Messages request bodies, declared once as msgspec Structs, and what they become:
chat messages for the model's template, the tools offered (pagedserve.handlers.openai_tools) and
SamplingParams.

- `max_tokens` is required, as Anthropic requires it; `temperature` is in [0, 1].
- `system` is a string or text blocks; message `content` is a string or blocks: `text`,
  `tool_use` (assistant), `tool_result` (user; its `tool_use_id` must answer a `tool_use` of
  the assistant turn before it). Images and documents are refused: the models here read text.
- `tool_choice`: `auto`, `any` (at least one call: OpenAI's "required"), `tool` (that tool:
  a named function), `none` (the tools are not offered); `disable_parallel_tool_use` allows one
  call. `any` and `tool` are enforced by the grammar engine.
- `output_config.format` (a JSON schema) constrains the answer through the grammar engine.
- Fields Anthropic accepts that change nothing here (`metadata`, `service_tier`,
  `cache_control`, `speed`, ..., and any field of a content block) are ignored; `thinking` other than disabled is refused; anything else unknown
  is refused with a 400 naming it, as Anthropic does.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import Annotated, Any, Literal

import msgspec
from msgspec import Meta

from pagedserve.engine.request.inputs import PromptSpec
from pagedserve.engine.sampling.params import MAX_TOKENS, SamplingParams
from pagedserve.handlers.base_handler import HandlerError
from pagedserve.handlers.llm_input import convert_body, make_sampling_params
from pagedserve.handlers.openai_tools import MAX_TOOLS, FunctionDef, ToolDef, ToolName, ToolRequest

_Text = Annotated[str, Meta(min_length=1)]


# Content blocks take fields they do not know (the SDK's own blocks, sent back as they came, carry
# `citations`, `caller`, `cache_control`, ... that change nothing here).
class TextBlock(msgspec.Struct, tag="text", tag_field="type"):
    text: str


class ToolUseBlock(msgspec.Struct, tag="tool_use", tag_field="type"):
    id: _Text
    name: ToolName
    input: dict[str, Any]


class ToolResultBlock(msgspec.Struct, tag="tool_result", tag_field="type"):
    tool_use_id: _Text
    content: str | list[TextBlock] = ""
    is_error: bool = False


class ImageBlock(msgspec.Struct, tag="image", tag_field="type"):
    source: Any = None


class DocumentBlock(msgspec.Struct, tag="document", tag_field="type"):
    source: Any = None


Block = TextBlock | ToolUseBlock | ToolResultBlock | ImageBlock | DocumentBlock


class Message(msgspec.Struct, forbid_unknown_fields=True):
    role: Literal["user", "assistant"]
    content: str | list[Block]


class Tool(msgspec.Struct, forbid_unknown_fields=True):
    name: ToolName
    input_schema: dict[str, Any]
    description: str | None = None
    type: Literal["custom"] | None = None
    cache_control: Any = None


class ToolChoice(msgspec.Struct, forbid_unknown_fields=True):
    type: Literal["auto", "any", "tool", "none"]
    name: ToolName | None = None
    disable_parallel_tool_use: bool = False


class Thinking(msgspec.Struct):
    type: Literal["enabled", "disabled"]
    budget_tokens: int | None = None


class _PromptBody(msgspec.Struct, forbid_unknown_fields=True, kw_only=True):
    """What count_tokens and messages share: the prompt."""

    model: _Text
    messages: Annotated[list[Message], Meta(min_length=1)]
    system: str | list[TextBlock] | None = None
    tools: Annotated[list[Tool], Meta(max_length=MAX_TOOLS)] | None = None
    tool_choice: ToolChoice | None = None
    thinking: Thinking | None = None


class CountTokensBody(_PromptBody, kw_only=True):
    pass


class JsonSchemaFormat(msgspec.Struct, tag="json_schema", tag_field="type", forbid_unknown_fields=True):
    schema: dict[str, Any]


class OutputConfig(msgspec.Struct, forbid_unknown_fields=True):
    format: JsonSchemaFormat | None = None  # structured output, enforced by the grammar engine
    effort: Any = None


class MessagesBody(_PromptBody, kw_only=True):
    max_tokens: Annotated[int, Meta(ge=1, le=MAX_TOKENS)]
    stop_sequences: list[_Text] | None = None
    stream: bool = False
    temperature: Annotated[float, Meta(ge=0, le=1)] | None = None
    top_p: float | None = None
    top_k: int | None = None
    output_config: OutputConfig | None = None
    # Accepted by Anthropic, no effect here.
    metadata: Any = None
    service_tier: Any = None
    cache_control: Any = None
    inference_geo: Any = None
    speed: Any = None
    user_profile_id: Any = None
    workspace_id: Any = None
    diagnostics: Any = None


@dataclass(slots=True)
class AnthropicRequest:
    model: str
    prompt: PromptSpec
    tools: ToolRequest | None
    params: SamplingParams = field(default_factory=SamplingParams)  # count_tokens: the defaults, unused
    stream: bool = False


def parse_messages(body: dict[str, Any]) -> AnthropicRequest:
    if "max_tokens" not in body:
        raise HandlerError("max_tokens: Field required", param="max_tokens")
    req = convert_body(body, MessagesBody)
    parsed = _prompt(req)
    fields: dict[str, Any] = {"max_tokens": req.max_tokens}
    for name in ("temperature", "top_p", "top_k"):
        if getattr(req, name) is not None:
            fields[name] = getattr(req, name)
    if req.stop_sequences:
        fields["stop"] = req.stop_sequences
    constraint = parsed.tools.constraint() if parsed.tools is not None else None
    if req.output_config is not None and req.output_config.format is not None:
        if constraint is not None:
            raise HandlerError(
                "output_config.format: cannot be combined with tool_choice any or tool", param="output_config.format"
            )
        constraint = req.output_config.format.schema
    if constraint is not None:
        fields["structured_outputs"] = {"json": json.dumps(constraint)}
    parsed.params = make_sampling_params(fields)
    parsed.stream = req.stream
    return parsed


def parse_count_tokens(body: dict[str, Any]) -> AnthropicRequest:
    return _prompt(convert_body(body, CountTokensBody))


def _prompt(req: _PromptBody) -> AnthropicRequest:
    if req.thinking is not None and req.thinking.type == "enabled":
        raise HandlerError("thinking: not supported: the models served here do not think aloud", param="thinking")
    tools = _tools(req.tools, req.tool_choice)
    messages = _system(req.system) + _messages(req.messages)
    return AnthropicRequest(req.model, PromptSpec(messages=messages), tools)


def _tools(tools: list[Tool] | None, choice: ToolChoice | None) -> ToolRequest | None:
    kind = choice.type if choice is not None else "auto"
    forced = choice.name if choice is not None else None
    if (kind == "tool") != (forced is not None):
        raise HandlerError("tool_choice.name: required with type \"tool\", and only then", param="tool_choice.name")
    if not tools:
        if kind in ("any", "tool"):
            raise HandlerError(f"tool_choice: type {kind!r} needs `tools`", param="tool_choice")
        return None
    names = [t.name for t in tools]
    if len(set(names)) != len(names):
        raise HandlerError("tools: tool names must be unique", param="tools")
    if kind == "none":
        return None
    if kind == "tool" and forced not in names:
        raise HandlerError(f"tool_choice.name: no tool named {forced!r} in tools", param="tool_choice.name")
    defs = [ToolDef("function", FunctionDef(t.name, t.description, t.input_schema)) for t in tools]
    parallel = not (choice is not None and choice.disable_parallel_tool_use)
    return ToolRequest(
        defs,
        {"auto": "auto", "any": "required", "tool": "function"}[kind],
        forced if kind == "tool" else None,
        parallel,
    )


def _system(system: str | list[TextBlock] | None) -> list[dict[str, Any]]:
    if not system:
        return []
    text = system if isinstance(system, str) else "".join(b.text for b in system)
    return [{"role": "system", "content": text}]


def _messages(messages: list[Message]) -> list[dict[str, Any]]:
    """Anthropic turns -> the chat template's messages (tool results become `tool` turns)."""
    out: list[dict[str, Any]] = []
    open_calls: set[str] = set()  # tool_use ids of the last assistant turn
    for i, m in enumerate(messages):
        blocks = [TextBlock(m.content)] if isinstance(m.content, str) else m.content
        texts: list[str] = []
        calls: list[dict[str, Any]] = []
        results: list[dict[str, Any]] = []
        for j, block in enumerate(blocks):
            where = f"messages[{i}].content[{j}]"
            if isinstance(block, (ImageBlock, DocumentBlock)):
                raise HandlerError(
                    f"{where}: {type(block).__name__.removesuffix('Block').lower()} blocks are not "
                    "supported: the models served here read text only",
                    param=where,
                )
            if isinstance(block, TextBlock):
                texts.append(block.text)
            elif isinstance(block, ToolUseBlock):
                if m.role != "assistant":
                    raise HandlerError(f"{where}: tool_use blocks belong to assistant turns", param=where)
                calls.append(
                    {"id": block.id, "type": "function", "function": {"name": block.name, "arguments": block.input}}
                )
            else:
                if m.role != "user":
                    raise HandlerError(f"{where}: tool_result blocks belong to user turns", param=where)
                if block.tool_use_id not in open_calls:
                    raise HandlerError(
                        f"{where}.tool_use_id: {block.tool_use_id!r} answers no tool_use block "
                        "of the assistant turn before it",
                        param=f"{where}.tool_use_id",
                    )
                content = block.content if isinstance(block.content, str) else "".join(b.text for b in block.content)
                results.append(
                    {
                        "role": "tool",
                        "tool_call_id": block.tool_use_id,
                        "content": ("Error: " if block.is_error else "") + content,
                    }
                )
        out += results
        if calls:
            out.append({"role": "assistant", "content": "".join(texts), "tool_calls": calls})
        elif texts or not results:
            out.append({"role": m.role, "content": "".join(texts)})
        open_calls = {c["id"] for c in calls} if m.role == "assistant" else set()
    return out
