"""Tool calling on /v1/chat/completions: the `tools` / `tool_choice` declarations, the prompt
(tools and tool turns through the chat template, or a Hermes-style default), the constraint that
enforces `required` and named choices, and the parsers that read calls out of generated text.

- `tool_choice: "none"` (or no tools): tools are not offered, the reply is plain text.
- `"auto"`: the tools are in the prompt; what the model wrote is parsed with the model's parser
  (model-config `toolParser`: `hermes` `<tool_call>{json}</tool_call>`, `llama3_json`
  `{"name": ..., "parameters": {...}}` separated by `;`, `mistral` `[TOOL_CALLS][{"name": ...,
  "arguments": {...}}]`, `pythonic` `[f(a=1), g(b="x")]`). Except for pythonic, the calls are
  bound to their tools' schemas by a structural tag (pagedserve.handlers.tool_tags): text until
  the trigger, then a call whose arguments validate.
- `"required"`: the output is constrained (xgrammar, a JSON schema) to a JSON array of
  `{"name", "arguments"}` objects, one per call, whose arguments follow that tool's
  `parameters` schema. The list is bounded: one call without `parallel_tool_calls`, else at
  most one per offered tool (MAX_PARALLEL_CALLS at most), and the grammar ends at its `]`, so
  a small model cannot write call after call until max_tokens. A list cut short by max_tokens
  still yields its complete calls.
- a named function: the output is constrained to that function's `parameters` schema and is
  the call's arguments (the grammar ends with the object).

Prompt: a chat template that mentions `tools` gets the tools and the tool turns as Hugging Face
templates expect them (`tools=`, assistant `tool_calls` with arguments as objects, `tool`
messages). Any other template gets the default: a system preamble listing the tools (Hermes'
wording, `<tools>...</tools>`), assistant calls written as `<tool_call>{json}</tool_call>`, and
tool results as user turns wrapped in `<tool_response>...</tool_response>`.
"""

from __future__ import annotations

import ast
import enum
import json
import re
import uuid
from dataclasses import dataclass, field
from typing import Annotated, Any, Literal

import msgspec
from msgspec import Meta

from pagedserve.engine.request.inputs import PromptSpec
from pagedserve.handlers.errors import HandlerError

MAX_TOOLS = 128
MAX_PARALLEL_CALLS = 8  # calls in one `required` answer (at most one per offered tool)
ToolName = Annotated[str, Meta(pattern=r"^[A-Za-z0-9_.-]{1,64}$")]


class ToolParser(enum.StrEnum):
    HERMES = "hermes"
    LLAMA3_JSON = "llama3_json"
    MISTRAL = "mistral"
    PYTHONIC = "pythonic"


class FunctionDef(msgspec.Struct, forbid_unknown_fields=True, omit_defaults=True):
    name: ToolName
    description: str | None = None
    parameters: dict[str, Any] | None = None
    strict: bool | None = None


class ToolDef(msgspec.Struct, forbid_unknown_fields=True):
    type: Literal["function"]
    function: FunctionDef


class NamedFunction(msgspec.Struct, forbid_unknown_fields=True):
    name: ToolName


class NamedToolChoice(msgspec.Struct, forbid_unknown_fields=True):
    type: Literal["function"]
    function: NamedFunction


Tools = Annotated[list[ToolDef], Meta(min_length=1, max_length=MAX_TOOLS)]
ToolChoice = Literal["none", "auto", "required"] | NamedToolChoice


@dataclass(slots=True)
class ToolRequest:
    """The checked tool fields of one chat request (absent when no tools are offered)."""

    tools: list[ToolDef]
    choice: str  # "auto", "required" or "function" (then `name`)
    name: str | None = None
    parallel: bool = True

    @property
    def schemas(self) -> list[dict[str, Any]]:
        """The tools as OpenAI (and Hugging Face chat templates) write them."""
        return [msgspec.to_builtins(t) for t in self.tools]

    def constraint(self) -> dict[str, Any] | None:
        """The JSON schema that enforces `required` or a named function (None for auto)."""
        if self.choice == "function":
            return parameters_schema(next(t.function for t in self.tools if t.function.name == self.name))
        if self.choice != "required":
            return None
        calls = [
            {
                "type": "object",
                "properties": {"name": {"const": t.function.name}, "arguments": parameters_schema(t.function)},
                "required": ["name", "arguments"],
                "additionalProperties": False,
            }
            for t in self.tools
        ]
        most = min(len(self.tools), MAX_PARALLEL_CALLS) if self.parallel else 1
        return {"type": "array", "minItems": 1, "maxItems": most, "items": {"anyOf": calls}}

    @property
    def forced(self) -> bool:
        """`required` or a named function: the answer is calls, whatever the model wanted."""
        return self.choice in ("required", "function")


def parameters_schema(function: FunctionDef) -> dict[str, Any]:
    return function.parameters if function.parameters is not None else {"type": "object"}


def tool_request(tools: list[ToolDef] | None, choice: ToolChoice | None, parallel: bool | None) -> ToolRequest | None:
    """Check `tools` / `tool_choice` / `parallel_tool_calls` together; None when no tool is offered."""
    if choice is None:
        choice = "auto" if tools else "none"
    if not tools:
        if choice != "none":
            raise HandlerError("tool_choice: needs `tools`", param="tool_choice")
        return None
    names = [t.function.name for t in tools]
    if len(set(names)) != len(names):
        raise HandlerError("tools: function names must be unique", param="tools")
    if choice == "none":
        return None
    if isinstance(choice, NamedToolChoice):
        if choice.function.name not in names:
            raise HandlerError(f"tool_choice: no tool named {choice.function.name!r} in tools", param="tool_choice")
        return ToolRequest(list(tools), "function", choice.function.name, parallel is not False)
    return ToolRequest(list(tools), choice, parallel=parallel is not False)


# -- the prompt -----------------------------------------------------------------------------------

_PREAMBLE = (
    "You are a function calling AI model. You are provided with function signatures within "
    "<tools></tools> XML tags. You may call one or more functions to assist with the user query. "
    "Don't make assumptions about what values to plug into functions. Here are the available tools: "
    "<tools>\n{tools}\n</tools>\nFor each function call return a json object with function name and "
    "arguments within <tool_call></tool_call> XML tags as follows:\n<tool_call>\n"
    '{{"name": <function-name>, "arguments": <args-json-object>}}\n</tool_call>'
)


def template_has_tools(chat_template: str | None) -> bool:
    return bool(chat_template) and "tools" in chat_template


def tool_prompt(spec: PromptSpec, tools: ToolRequest | None, chat_template: str | None) -> PromptSpec:
    """A chat prompt with the offered tools and the history's tool turns rendered for this
    model's chat template (unchanged when there are neither)."""
    if tools is None and not any(m["role"] == "tool" or m.get("tool_calls") for m in spec.messages or ()):
        return spec
    messages, for_template = render_tool_messages(spec.messages, tools, chat_template)
    return PromptSpec(messages=messages, add_generation_prompt=spec.add_generation_prompt, tools=for_template)


def render_tool_messages(
    messages: list[dict[str, Any]], tools: ToolRequest | None, chat_template: str | None
) -> tuple[list[dict[str, Any]], list[dict[str, Any]] | None]:
    """Messages with tool turns (and the offered tools) -> what to hand the chat template:
    (messages, tools for the template's `tools=`, or None)."""
    if template_has_tools(chat_template):
        return messages, tools.schemas if tools is not None else None
    out = []
    for m in messages:
        if m["role"] == "tool":
            out.append({"role": "user", "content": f"<tool_response>\n{m['content']}\n</tool_response>"})
        elif m.get("tool_calls"):
            calls = "".join(
                f"<tool_call>\n{json.dumps({'name': c['function']['name'], 'arguments': c['function']['arguments']})}"
                "\n</tool_call>"
                for c in m["tool_calls"]
            )
            out.append({"role": "assistant", "content": (m["content"] or "") + calls})
        else:
            out.append({"role": m["role"], "content": m["content"]})
    if tools is not None:
        preamble = _PREAMBLE.format(tools="\n".join(json.dumps(t) for t in tools.schemas))
        if out[0]["role"] == "system":
            out[0] = {"role": "system", "content": out[0]["content"] + "\n\n" + preamble}
        else:
            out.insert(0, {"role": "system", "content": preamble})
    return out, None


# -- reading calls out of the output --------------------------------------------------------------


@dataclass(slots=True)
class ToolCall:
    name: str
    arguments: str  # JSON text
    id: str = field(default_factory=lambda: "call_" + uuid.uuid4().hex[:24])

    def as_openai(self) -> dict[str, Any]:
        return {"id": self.id, "type": "function", "function": {"name": self.name, "arguments": self.arguments}}


@dataclass(slots=True)
class ParsedOutput:
    content: str | None
    calls: list[ToolCall]


def parse_output(text: str, tools: ToolRequest, parser: ToolParser) -> ParsedOutput:
    """The calls in a finished choice's text (none: the text is the content)."""
    try:
        if tools.choice == "function":
            json.loads(text)
            return ParsedOutput(None, [ToolCall(tools.name, text)])
        if tools.choice == "required":
            return ParsedOutput(None, [_call(c.get("name"), c.get("arguments")) for c in _call_list(text)])
        return _PARSERS[parser](text)
    except (ValueError, TypeError, AttributeError, SyntaxError):
        return ParsedOutput(text, [])  # not a well-formed call (e.g. cut off by max_tokens)


def _call_list(text: str) -> list[dict[str, Any]]:
    """The complete calls of a `required` answer's JSON list, also when max_tokens cut the list
    short (the grammar guarantees every complete item is a well-formed call)."""
    try:
        return json.loads(text)
    except ValueError:
        pass
    decoder, calls, pos = json.JSONDecoder(), [], text.find("[") + 1
    if pos == 0:
        raise ValueError("not a list of calls")
    while True:
        try:
            call, pos = decoder.raw_decode(text, pos)
        except ValueError:
            break
        calls.append(call)
        pos = len(text) - len(text[pos:].lstrip().removeprefix(",").lstrip())
    if not calls:
        raise ValueError("no complete call")
    return calls


def _call(name: Any, arguments: Any) -> ToolCall:
    if not isinstance(name, str) or not isinstance(arguments, (dict, str)):
        raise TypeError("a call needs a name and arguments")
    return ToolCall(name, arguments if isinstance(arguments, str) else json.dumps(arguments))


_HERMES = re.compile(r"<tool_call>\s*(.*?)\s*(?:</tool_call>|$)", re.DOTALL)


def parse_hermes(text: str) -> ParsedOutput:
    start = text.find("<tool_call>")
    if start < 0:
        return ParsedOutput(text, [])
    calls = []
    for body in _HERMES.findall(text[start:]):
        call = json.loads(body)
        calls.append(_call(call.get("name"), call.get("arguments", call.get("parameters"))))
    return ParsedOutput(text[:start].strip() or None, calls)


_LLAMA3_CALL = re.compile(r'<\|python_tag\|>|\{\s*"name"\s*:')


def parse_llama3_json(text: str) -> ParsedOutput:
    """Calls from the python tag or the first `{"name": ` on (text before them is the content),
    separated by `;`."""
    found = _LLAMA3_CALL.search(text)
    if found is None:
        return ParsedOutput(text, [])
    body = text[found.start() :].removeprefix("<|python_tag|>").strip()
    decoder, calls, pos = json.JSONDecoder(), [], 0
    while pos < len(body) and (not calls or body[pos] == "{"):  # text after the calls is dropped
        call, pos = decoder.raw_decode(body, pos)
        calls.append(_call(call.get("name"), call.get("parameters", call.get("arguments"))))
        pos = len(body) - len(body[pos:].lstrip().removeprefix(";").lstrip().removeprefix("<|python_tag|>").lstrip())
    return ParsedOutput(text[: found.start()].strip() or None, calls)


def parse_mistral(text: str) -> ParsedOutput:
    """`[TOOL_CALLS]` then a JSON list of calls (again after each further `[TOOL_CALLS]`)."""
    start = text.find("[TOOL_CALLS]")
    if start < 0:
        return ParsedOutput(text, [])
    decoder, calls = json.JSONDecoder(), []
    for part in text[start:].split("[TOOL_CALLS]")[1:]:
        listed, _ = decoder.raw_decode(part.strip())
        for call in listed if isinstance(listed, list) else [listed]:
            calls.append(_call(call.get("name"), call.get("arguments", call.get("parameters"))))
    return ParsedOutput(text[:start].strip() or None, calls)


def parse_pythonic(text: str) -> ParsedOutput:
    body = text.strip().removeprefix("<|python_start|>").removesuffix("<|python_end|>").strip()
    if not (body.startswith("[") and body.endswith("]")):
        return ParsedOutput(text, [])
    tree = ast.parse(body, mode="eval").body
    if not isinstance(tree, ast.List) or not all(
        isinstance(c, ast.Call) and isinstance(c.func, ast.Name) and not c.args for c in tree.elts
    ):
        return ParsedOutput(text, [])
    return ParsedOutput(
        None, [_call(c.func.id, {k.arg: ast.literal_eval(k.value) for k in c.keywords}) for c in tree.elts]
    )


_PARSERS = {
    ToolParser.HERMES: parse_hermes,
    ToolParser.LLAMA3_JSON: parse_llama3_json,
    ToolParser.MISTRAL: parse_mistral,
    ToolParser.PYTHONIC: parse_pythonic,
}
