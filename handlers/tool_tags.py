"""Structural tags for `tool_choice: "auto"`: the model writes free text until its tool-call
trigger, after which the called tool's JSON schema binds the call (xgrammar's `triggered_tags`),
so every call the parser reads out of an `auto` answer has arguments that validate.

One `CallFormat` per tool parser (model-config `toolParser`), i.e. per chat-template family:

| parser | families | a call as the model writes it |
| --- | --- | --- |
| `hermes` | Hermes, Qwen 2.5 / 3, and every template without a tools section (SmolLM2, Gemma 3: they get the Hermes preamble, pagedserve.handlers.openai_tools) | `<tool_call>\\n{"name": "f", "arguments": {...}}\\n</tool_call>` |
| `llama3_json` | Llama 3.1 / 3.2 / 3.3 | `{"name": "f", "parameters": {...}}` (or after `<\\|python_tag\\|>`) |
| `mistral` | Mistral (v3 tokenizer and later) | `[TOOL_CALLS][{"name": "f", "arguments": {...}}]` |
| `pythonic` | Llama 4, Gemma 3 pythonic templates | no tag: Python call syntax is not a JSON schema (the output is parsed, not constrained) |

Each tag is `begin` (trigger + the tool's name + the arguments' key), the tool's `parameters`
schema, `end`; the text between calls stays free (`parallel_tool_calls: false` ends the answer
after the first call). The tag is the request's structured-output constraint, so a body that
asks for its own structured output (response_format, ...) keeps that instead.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import msgspec

from pagedserve.engine.sampling.params import SamplingParams
from pagedserve.engine.structured_output.params import StructuredOutputsParams
from pagedserve.handlers.openai_tools import ToolParser, ToolRequest, parameters_schema


@dataclass(frozen=True, slots=True)
class CallFormat:
    """How one family writes a call: one of `openers`, `body` ({name} is the tool's name, it ends
    with the arguments' key), the arguments (the tool's schema), `end`. Every opener + body
    starts with one of `triggers` (the text that switches from free text to a call)."""

    triggers: tuple[str, ...]
    openers: tuple[str, ...]
    body: str
    end: str

    def tags(self, name: str, schema: dict[str, Any]) -> list[dict[str, Any]]:
        return [
            {
                "type": "tag",
                "begin": opener + self.body.format(name=name),
                "content": {"type": "json_schema", "json_schema": schema, "max_whitespace_cnt": MAX_WHITESPACE},
                "end": self.end,
            }
            for opener in self.openers
        ]


# Whitespace characters in a row inside a call (pretty-printed JSON fits; a small model cannot
# fill its answer with blank lines).
MAX_WHITESPACE = 16

CALL_FORMATS: dict[ToolParser, CallFormat] = {
    ToolParser.HERMES: CallFormat(
        ("<tool_call>",), ("<tool_call>",), '\n{{"name": "{name}", "arguments": ', "}\n</tool_call>"
    ),
    # Llama 3 writes bare JSON calls, or after the python tag (special, often dropped by decode).
    ToolParser.LLAMA3_JSON: CallFormat(
        ("<|python_tag|>", '{"name": '), ("<|python_tag|>", ""), '{{"name": "{name}", "parameters": ', "}"
    ),
    ToolParser.MISTRAL: CallFormat(("[TOOL_CALLS]",), ("[TOOL_CALLS]",), '[{{"name": "{name}", "arguments": ', "}]"),
}


def structural_tag(tools: ToolRequest, parser: ToolParser) -> dict[str, Any] | None:
    """The structural tag that binds `tool_choice: "auto"` calls to their tools' schemas for
    this parser's call format; None where the family has none (pythonic)."""
    form = CALL_FORMATS.get(parser)
    if form is None:
        return None
    return {
        "type": "structural_tag",
        "format": {
            "type": "triggered_tags",
            "triggers": list(form.triggers),
            "tags": [tag for t in tools.tools for tag in form.tags(t.function.name, parameters_schema(t.function))],
            "stop_after_first": not tools.parallel,
        },
    }


def with_tool_constraint(params: SamplingParams, tools: ToolRequest | None, parser: ToolParser) -> SamplingParams:
    """`params` with the structural tag of an `auto` tool request as its constraint (unchanged
    without tools, for `required` / a named function, which carry a JSON schema already, when
    the body asked for its own structured output, or when the family has no tag)."""
    if tools is None or tools.choice != "auto" or params.structured_outputs is not None:
        return params
    tag = structural_tag(tools, parser)
    if tag is None:
        return params
    return msgspec.structs.replace(params, structured_outputs=StructuredOutputsParams(structural_tag=tag))
