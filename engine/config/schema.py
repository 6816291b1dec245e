"""Declared schemas: msgspec Structs checked by `msgspec.convert`, with errors that name the
field, the value and what is allowed, the same way everywhere ("max_tokens: must be >= 1, got 0",
"unknown field 'foo'").

Every request body, wire message and config file of the server is a Struct declared once, with
its bounds as `Annotated[..., msgspec.Meta(...)]`; this module turns msgspec's own messages
("Expected `int` >= 1 - at `$.max_tokens`") into that one format. `Struct.__init__` checks
nothing, so a Struct built in Python calls `check_fields` from its `__post_init__`.
"""

from __future__ import annotations

import json
import re
from typing import Any, TypeVar

import msgspec

T = TypeVar("T")
S = TypeVar("S", bound=msgspec.Struct)

_AT = re.compile(r"^(?P<msg>.*?)(?: - at `\$(?P<path>[^`]*)`)?$", re.DOTALL)
_SECRET = re.compile(r"(key|token|secret|password)$", re.IGNORECASE)
_GOT = re.compile(r"^Expected `(?P<want>[^`]+)`, got `(?P<got>[^`]+)`$")
_BOUND = re.compile(r"^Expected `(?P<want>[^`]+)` (?P<op>>=|<=|>|<) (?P<limit>\S+)$")
_LENGTH = re.compile(r"^Expected `(?P<want>[^`]+)` of length (?P<op>>=|<=) (?P<limit>\d+)$")
_UNKNOWN = re.compile(r"^Object contains unknown field `(?P<name>[^`]+)`$")
_MISSING = re.compile(r"^Object missing required field `(?P<name>[^`]+)`$")
_ENUM = re.compile(r"^Invalid enum value ")
_REGEX = re.compile(r"^Expected `str` matching regex '(?P<regex>.*)'$", re.DOTALL)
_NAMED = re.compile(r"^(?P<name>[A-Za-z_][\w.\[\]]*): (?P<rest>.*)$", re.DOTALL)
_PATH_PART = re.compile(r"\.([^.\[]+)|\[(\d+)\]")
_KINDS = {
    "int": "an integer",
    "float": "a number",
    "str": "a string",
    "bool": "true or false",
    "array": "a list",
    "object": "an object",
    "null": "null",
}
_LENGTH_WORDS = {"str": "characters", "array": "items", "object": "keys"}
_SIZE_WORDS = {">=": "at least", "<=": "at most"}
MAX_SHOWN = 60  # characters of a refused value quoted back


class SchemaError(ValueError):
    """A value a schema refuses. `field` is its dotted path ("stop[3]", "structured_outputs.regex"),
    None for the whole object; the message starts with it."""

    def __init__(self, message: str, field: str | None = None) -> None:
        super().__init__(message)
        self.field = field


def convert(data: Any, schema: type[T], *, strict: bool = True) -> T:
    """`msgspec.convert(data, schema)` with a `SchemaError` naming the field on refusal.
    `strict=False` also reads numbers and booleans from strings (query strings, environment)."""
    try:
        return msgspec.convert(data, schema, strict=strict)
    except msgspec.ValidationError as exc:
        raise schema_error(exc, data, schema) from None


def check_fields(obj: msgspec.Struct, schema: type[S]) -> S:
    """Check a Struct built in Python against `schema` (its declaration without `__post_init__`):
    types and bounds, as decoding would. Returns the checked copy (nested mappings converted)."""
    try:
        data = msgspec.to_builtins(obj)
    except (TypeError, ValueError) as exc:
        raise SchemaError(f"{type(obj).__name__}: {exc}") from None
    return convert(data, schema)


def schema_error(exc: msgspec.ValidationError, data: Any = None, schema: Any = None) -> SchemaError:
    """msgspec's message -> "field: must be ..., got VALUE" (the value read back from `data`, the
    allowed values of a Literal or Enum field read from `schema`)."""
    match = _AT.match(str(exc))
    assert match is not None  # every string matches: the location part is optional
    message, path = match["msg"], _field_name(match["path"] or "")
    secret = _SECRET.search(path or "") is not None  # a refused key or token is never echoed
    value = _MISSING_VALUE if secret else _lookup(data, match["path"] or "")
    if found := _UNKNOWN.match(message):
        return SchemaError(f"{_prefix(path)}unknown field '{found['name']}'", _join(path, found["name"]))
    if found := _MISSING.match(message):
        name = _join(path, found["name"])
        return SchemaError(f"{name}: is required", name)
    if found := _GOT.match(message):
        text = f"must be {_kind(found['want'])}{_got(value) or ('' if secret else ', got ' + found['got'])}"
    elif found := _BOUND.match(message):
        text = f"must be {found['op']} {found['limit']}{_got(value)}"
    elif (found := _LENGTH.match(message)) and found["op"] == ">=" and found["limit"] == "1":
        text = "must not be empty"
    elif found := _LENGTH.match(message):
        kind = found["want"].split(" ")[0]
        size = f", got {len(value)}" if isinstance(value, (str, list, dict)) else ""  # a length only
        text = f"must have {_SIZE_WORDS[found['op']]} {found['limit']} {_LENGTH_WORDS.get(kind, 'items')}{size}"
        if kind == "str":
            text = f"must be {_SIZE_WORDS[found['op']]} {found['limit']} characters long{size}"
    elif _REGEX.match(message) and (expected := _expected(schema, match["path"] or "")):
        text = f"must be {expected}{_got(value)}"
    elif found := _REGEX.match(message):
        text = f"must match {found['regex'].replace(chr(92) * 2, chr(92))}{_got(value)}"
    elif _ENUM.match(message) and (allowed := _allowed(schema, match["path"] or "")):
        text = f"must be one of {', '.join(show(v) for v in allowed)}{_got(value)}"
    elif found := _NAMED.match(message):  # a __post_init__ message that names its own field
        named = found["name"]
        name = named if path and named.startswith(f"{path}.") else _join(path, named)
        return SchemaError(f"{name}: {found['rest']}", name)
    else:
        text = message[0].lower() + message[1:] if message else "invalid value"
    return SchemaError(f"{_prefix(path)}{text}", path)


def show(value: Any) -> str:
    """A refused value as JSON, shortened."""
    try:
        text = json.dumps(value, ensure_ascii=True, default=repr)
    except (TypeError, ValueError):
        text = repr(value)
    return text if len(text) <= MAX_SHOWN else text[: MAX_SHOWN - 3] + "..."


_MISSING_VALUE = object()


def _got(value: Any) -> str:
    return "" if value is _MISSING_VALUE else f", got {show(value)}"


def _lookup(data: Any, path: str) -> Any:
    for key, index in _PATH_PART.findall(path):
        try:
            data = data[int(index)] if index else data[key]
        except (KeyError, IndexError, TypeError, ValueError):
            return _MISSING_VALUE
    return data


def _field_type(schema: Any, path: str) -> Any:
    """msgspec's description of the field at `path` (msgspec's "$.a.b" form) of `schema`."""
    if schema is None:
        return None
    try:
        info: Any = msgspec.inspect.type_info(schema)
    except (TypeError, ValueError):
        return None
    for key, index in _PATH_PART.findall(path):
        info = _unwrap(info)
        if index:
            info = getattr(info, "item_type", None)
        elif isinstance(info, (msgspec.inspect.StructType, msgspec.inspect.DataclassType)):
            info = next((f.type for f in info.fields if f.encode_name == key), None)
        elif isinstance(info, msgspec.inspect.DictType):
            info = info.value_type
        else:
            return None
    return info


def _allowed(schema: Any, path: str) -> list[Any]:
    """The values a Literal or Enum field at `path` of `schema` allows."""
    info = _unwrap(_field_type(schema, path), want=(msgspec.inspect.LiteralType, msgspec.inspect.EnumType))
    if isinstance(info, msgspec.inspect.LiteralType):
        return list(info.values)
    if isinstance(info, msgspec.inspect.EnumType):
        return [member.value for member in info.cls]
    return []


def _expected(schema: Any, path: str) -> str | None:
    """A field's own words for what it takes (`Meta(extra={"expected": ...})`), if it has them."""
    info = _field_type(schema, path)
    members = info.types if isinstance(info, msgspec.inspect.UnionType) else (info,)
    for member in members:
        if isinstance(member, msgspec.inspect.Metadata) and isinstance(member.extra, dict):
            return member.extra.get("expected")
    return None


def _unwrap(
    info: Any,
    want: tuple = (
        msgspec.inspect.StructType,
        msgspec.inspect.DataclassType,
        msgspec.inspect.DictType,
        msgspec.inspect.ListType,
    ),
) -> Any:
    """The member of a union (`X | None`) of the kind wanted."""
    if isinstance(info, msgspec.inspect.UnionType):
        return next((t for t in info.types if isinstance(t, want)), info)
    return info


def _field_name(path: str) -> str | None:
    return path.removeprefix(".") or None


def _join(path: str | None, name: str) -> str:
    return f"{path}.{name}" if path else name


def _prefix(path: str | None) -> str:
    return f"{path}: " if path else ""


def _kind(types: str) -> str:
    kinds = [_KINDS.get(t, t) for t in types.split(" | ")]
    return kinds[0] if len(kinds) == 1 else f"{', '.join(kinds[:-1])} or {kinds[-1]}"
