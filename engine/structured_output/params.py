"""The request side of structured output: which constraint a request asks for
(`StructuredOutputsParams`, carried on SamplingParams) and `check_grammar`, the cheap parse that
refuses a bad schema, regex or grammar before the request reaches a worker.

The engine side (compiling grammars, filling the bitmask) is `pagedserve.engine.structured_output.manager`.
"""

from __future__ import annotations

import json
import re
from typing import Annotated, Any

import msgspec

from pagedserve.engine.config.schema import SchemaError, check_fields
from pagedserve.engine.structured_output.limits import check_constraint_size

MAX_CONSTRAINT_CHARS = 65_536  # a regex, a grammar or a JSON schema's text
MAX_CHOICES = 256
_XGRAMMAR_PREFIX = re.compile(r"^\[[^\]]*\]\s*\S+:\d+:\s*")  # "[time] file.cc:123: " before messages

_KINDS = ("json", "regex", "choice", "grammar", "structural_tag")
_Text = Annotated[str, msgspec.Meta(min_length=1, max_length=MAX_CONSTRAINT_CHARS)]


class GrammarError(ValueError):
    """A constraint xgrammar cannot parse or compile; the message says why."""


class _ConstraintFields(msgspec.Struct, forbid_unknown_fields=True):
    """The declaration (types and bounds) of StructuredOutputsParams."""

    # A JSON schema: an object, or its JSON text (kept as text once checked).
    json: _Text | dict[str, Any] | None = None
    json_object: bool = False
    regex: _Text | None = None
    choice: Annotated[list[_Text], msgspec.Meta(min_length=1, max_length=MAX_CHOICES)] | None = None
    grammar: _Text | None = None  # EBNF (xgrammar's dialect, GBNF-like), with a `root` rule
    # An xgrammar structural tag ({"type": "structural_tag", "format": {...}}): e.g. free text
    # until a trigger, then a JSON schema (tool calls: pagedserve.handlers.tool_tags). JSON text once checked.
    structural_tag: _Text | dict[str, Any] | None = None


class StructuredOutputsParams(_ConstraintFields):
    """Exactly one constraint (vLLM's name and fields). `json` holds the schema's JSON text."""

    def __post_init__(self) -> None:
        check_fields(self, _ConstraintFields)
        if isinstance(self.json, dict):
            self.json = json.dumps(self.json)
        if isinstance(self.structural_tag, dict):
            self.structural_tag = json.dumps(self.structural_tag)
        given = [name for name in _KINDS if getattr(self, name) is not None]
        if self.json_object:
            given.append("json_object")
        if len(given) != 1:
            raise SchemaError(
                f"give exactly one of json, json_object, regex, choice, grammar or structural_tag; "
                f"got {', '.join(given) or 'none'}"
            )
        if self.structural_tag is not None:
            if len(self.structural_tag) > MAX_CONSTRAINT_CHARS:
                raise SchemaError(
                    f"structural_tag: must be at most {MAX_CONSTRAINT_CHARS} characters long as JSON text, "
                    f"got {len(self.structural_tag)}",
                    "structural_tag",
                )
            try:
                tag = json.loads(self.structural_tag)
            except json.JSONDecodeError as exc:
                raise SchemaError(f"structural_tag: not valid JSON: {exc}", "structural_tag") from None
            if not isinstance(tag, dict):
                raise SchemaError("structural_tag: must be an object", "structural_tag")
        if self.json is not None:
            if len(self.json) > MAX_CONSTRAINT_CHARS:
                raise SchemaError(
                    f"json: must be at most {MAX_CONSTRAINT_CHARS} characters long as JSON text, got {len(self.json)}",
                    "json",
                )
            try:
                schema = json.loads(self.json)
            except json.JSONDecodeError as exc:
                raise SchemaError(f"json: the JSON schema is not valid JSON: {exc}", "json") from None
            if not isinstance(schema, (dict, bool)):
                raise SchemaError("json: a JSON schema must be an object", "json")

    @property
    def kind(self) -> str:
        for name in _KINDS:
            if getattr(self, name) is not None:
                return name
        return "json_object"

    def choice_grammar(self) -> str:
        """The EBNF grammar that matches exactly one of the choices."""
        assert self.choice is not None
        return "root ::= " + " | ".join(json.dumps(c, ensure_ascii=False) for c in self.choice)


def xgrammar_module():
    try:
        import xgrammar
    except ImportError as exc:  # pragma: no cover - xgrammar is a dependency
        raise GrammarError("structured output needs the xgrammar package") from exc
    return xgrammar


def xgrammar_message(exc: Exception) -> str:
    """xgrammar's first line, without its "[time] file.cc:123:" prefix."""
    text = str(exc).strip()
    return _XGRAMMAR_PREFIX.sub("", text.splitlines()[0] if text else type(exc).__name__)


def check_grammar(params: StructuredOutputsParams) -> None:
    """Parse the constraint without a tokenizer (about a millisecond); GrammarError if invalid,
    ConstraintTooLarge (a ValueError) if nested too deep (checked first, see constraint_limits)."""
    check_constraint_size(params)
    xgr = xgrammar_module()
    try:
        if params.json is not None:
            xgr.Grammar.from_json_schema(params.json, any_whitespace=False)
        elif params.regex is not None:
            xgr.Grammar.from_regex(params.regex)
        elif params.choice is not None:
            xgr.Grammar.from_ebnf(params.choice_grammar())
        elif params.grammar is not None:
            xgr.Grammar.from_ebnf(params.grammar)
        elif params.structural_tag is not None:
            xgr.Grammar.from_structural_tag(params.structural_tag)
    except (RuntimeError, ValueError) as exc:
        raise GrammarError(f"invalid {params.kind} constraint: {xgrammar_message(exc)}") from None
