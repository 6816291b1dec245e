"""MkDocs hook: the configuration reference, generated from the config schemas.

Each `<!-- schema: module:Class -->` line in a page is replaced, at build time, by a table of
that schema's fields: key, type with its declared bounds, default, and the comment written
beside the field in the source (the line's trailing comment and the comment lines just above
it). The schemas are the one declaration; the page is never written by hand.
"""

from __future__ import annotations

import enum
import importlib
import inspect
import io
import re
import sys
import tokenize
from pathlib import Path
from typing import Any

import msgspec

ROOT = Path(__file__).resolve().parents[2]
MARKER = re.compile(r"^<!-- schema: (?P<module>[\w.]+):(?P<name>\w+)(?P<camel> camel)? -->$", re.MULTILINE)


def on_page_markdown(markdown: str, **_: Any) -> str:
    if "<!-- schema:" not in markdown:
        return markdown
    if str(ROOT) not in sys.path:  # the checkout's packages, also when another copy is installed
        sys.path.insert(0, str(ROOT))
    return MARKER.sub(lambda m: schema_table(getattr(importlib.import_module(m["module"]), m["name"])), markdown)


def schema_table(cls: type) -> str:
    """A markdown table of `cls`'s fields (a msgspec Struct or a dataclass)."""
    info = msgspec.inspect.type_info(cls)
    comments = field_comments(cls)
    rows = ["| key | type | default | meaning |", "| --- | --- | --- | --- |"]
    for field in info.fields:
        default = "required" if field.required else _default(field)
        text = comments.get(field.name, "").replace("|", "\\|")
        rows.append(f"| `{field.encode_name}` | {type_text(field.type)} | {default} | {text} |")
    doc = inspect.getdoc(cls) or ""
    first = doc.split("\n\n")[0].replace("\n", " ")
    return f"{first}\n\n" + "\n".join(rows) if first else "\n".join(rows)


def field_comments(cls: type) -> dict[str, str]:
    """Field name -> the comments beside its declaration in the class body (and its bases')."""
    found: dict[str, str] = {}
    for klass in reversed(cls.__mro__):
        if klass.__module__ in ("builtins", "msgspec") or klass.__module__.startswith("msgspec"):
            continue
        try:
            source = inspect.getsource(klass)
        except (OSError, TypeError):
            continue
        found.update(_comments(source))
    return found


_FIELD = re.compile(r"^    (?P<name>[A-Za-z_]\w*)\s*:")


def _comments(source: str) -> dict[str, str]:
    lines = source.splitlines()
    trailing: dict[int, str] = {}
    for tok in tokenize.generate_tokens(io.StringIO(source).readline):
        if tok.type == tokenize.COMMENT:
            trailing[tok.start[0] - 1] = tok.string.lstrip("#").strip()
    out: dict[str, str] = {}
    for number, line in enumerate(lines):
        match = _FIELD.match(line)
        if not match or line.strip().startswith("#"):
            continue
        above: list[str] = []
        index = number - 1
        while index >= 0 and lines[index].strip().startswith("#"):
            above.insert(0, lines[index].strip().lstrip("#").strip())
            index -= 1
        text = " ".join([*above, trailing.get(number, "") if not line.strip().startswith("#") else ""]).strip()
        if text:
            out[match["name"]] = text
    return out


def _default(field: msgspec.inspect.Field) -> str:
    value = field.default
    if value is msgspec.NODEFAULT and field.default_factory is not msgspec.NODEFAULT:
        value = field.default_factory()
    if isinstance(value, enum.Enum):
        value = value.value
    if value is None:
        return "none"
    return f"`{msgspec.json.encode(value).decode() if not isinstance(value, str) else value}`"


def type_text(t: msgspec.inspect.Type) -> str:
    """A type with its bounds, in words: `integer >= 1`, `"fcfs" or "priority"`, ..."""
    mi = msgspec.inspect
    if isinstance(t, mi.UnionType):
        return " or ".join(type_text(member) for member in t.types)
    if isinstance(t, mi.NoneType):
        return "none"
    if isinstance(t, mi.BoolType):
        return "boolean"
    if isinstance(t, (mi.IntType, mi.FloatType)):
        name = "integer" if isinstance(t, mi.IntType) else "number"
        bounds = [
            f"{op} {getattr(t, attr)}"
            for attr, op in (("ge", ">="), ("gt", ">"), ("le", "<="), ("lt", "<"))
            if getattr(t, attr) is not None
        ]
        return f"{name} {', '.join(bounds)}".strip()
    if isinstance(t, mi.StrType):
        extra = [f"pattern `{t.pattern}`"] if t.pattern else []
        if t.min_length:
            extra.append(f"at least {t.min_length} characters")
        if t.max_length is not None:
            extra.append(f"at most {t.max_length} characters")
        return "string" + (f" ({', '.join(extra)})" if extra else "")
    if isinstance(t, mi.LiteralType):
        return " or ".join(f"`{value}`" for value in t.values)
    if isinstance(t, mi.EnumType):
        return " or ".join(f"`{member.value}`" for member in t.cls)
    if isinstance(t, (mi.ListType, mi.SetType, mi.FrozenSetType, mi.VarTupleType)):
        return f"list of {type_text(t.item_type)}"
    if isinstance(t, mi.DictType):
        return "mapping"
    if isinstance(t, (mi.StructType, mi.DataclassType)):
        return f"mapping ({t.cls.__name__})"
    if isinstance(t, mi.AnyType):
        return "any"
    return type(t).__name__.removesuffix("Type").lower()
