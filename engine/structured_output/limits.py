"""Size and nesting bounds on a structured-output constraint, checked before xgrammar sees it.

xgrammar's parse of a JSON schema grows roughly with the cube of its nesting depth (arrays nested
300 deep take seconds, 900 deep over 30 s), and a compile costs more than the parse. The
declaration (engine/structured_output/params.py) bounds each text's length and the number of
choices; these cheap structural checks add what a length bound cannot see, each with a message
naming the limit:

- a JSON schema (or a structural tag, schemas included) nested at most MAX_SCHEMA_DEPTH objects/arrays deep (a typical schema stays under
  20; depth 64 parses in a few tens of milliseconds);
- a regex or grammar with groups nested at most MAX_GROUP_DEPTH deep;
- the choices of a choice constraint at most MAX_CHOICE_CHARS characters together.

The scans are linear in the text and never recurse, so they are safe on any input. The server
still runs the parse itself with a time limit (server/serving/limits.py): these bounds make it cheap,
the time limit catches what they miss.
"""

from __future__ import annotations

import re
from typing import Any

MAX_CHOICE_CHARS = 65_536
MAX_SCHEMA_DEPTH = 64
MAX_GROUP_DEPTH = 64

# JSON text: string literals (skipped) or brackets.
_JSON_TOKENS = re.compile(r'"(?:[^"\\]|\\.)*"|[\[\]{}]', re.DOTALL)
# A regex: escapes and character classes (skipped: their brackets are literal) or parentheses.
_REGEX_TOKENS = re.compile(r"\\.|\[(?:\\.|[^\]\\])*\]|[()]", re.DOTALL)
# EBNF (xgrammar's dialect): escapes, string literals, character classes (skipped) or parentheses.
_EBNF_TOKENS = re.compile(r"\\.|\"(?:\\.|[^\"\\])*\"|'(?:\\.|[^'\\])*'|\[(?:\\.|[^\]\\])*\]|[()]", re.DOTALL)


class ConstraintTooLarge(ValueError):
    """A constraint over one of the bounds above; the message names the bound."""


def check_constraint_size(params: Any) -> None:
    """Refuse a StructuredOutputsParams whose constraint is over a size or nesting bound."""
    if params.json is not None or params.structural_tag is not None:
        what = "JSON schema" if params.json is not None else "structural tag"
        depth = _depth(params.json or params.structural_tag, _JSON_TOKENS, "[{")
        if depth > MAX_SCHEMA_DEPTH:
            raise ConstraintTooLarge(
                f"the {what} is nested {depth} levels deep; at most {MAX_SCHEMA_DEPTH} are allowed"
            )
    elif params.regex is not None:
        _check_groups("regex", params.regex, _REGEX_TOKENS)
    elif params.grammar is not None:
        _check_groups("grammar", params.grammar, _EBNF_TOKENS)
    elif params.choice is not None:
        total = sum(len(c) for c in params.choice)
        if total > MAX_CHOICE_CHARS:
            raise ConstraintTooLarge(
                f"the structured output choices have {total} characters "
                f"together; at most {MAX_CHOICE_CHARS} are allowed"
            )


def _check_groups(what: str, text: str, tokens: re.Pattern[str]) -> None:
    depth = _depth(text, tokens, "(")
    if depth > MAX_GROUP_DEPTH:
        raise ConstraintTooLarge(f"the {what} nests groups {depth} deep; at most {MAX_GROUP_DEPTH} are allowed")


def _depth(text: str, tokens: re.Pattern[str], openers: str) -> int:
    """Deepest nesting of the single-character brackets among `tokens` (others are skipped)."""
    depth = deepest = 0
    for match in tokens.finditer(text):
        token = match.group()
        if len(token) != 1:
            continue
        if token in openers:
            depth += 1
            deepest = max(deepest, depth)
        else:
            depth = max(depth - 1, 0)
    return deepest
