"""Request bodies -> JSON objects, for every JSON route: the size checked before parsing, a
nesting-depth limit, and refusals that name the field at fault.

msgspec parses (fast, and it refuses what the engine could not carry: lone surrogates, numbers
beyond a float, `NaN`/`Infinity`). When it refuses a body, Python's json module parses it again
only to say where: "messages[0].content: contains a lone surrogate", "temperature: must be a
finite number, got Infinity". A deeper body than `MAX_JSON_DEPTH` is a 400, never a
RecursionError.
"""

from __future__ import annotations

import json
import math
import sys
from typing import Any

import msgspec

from pagedserve.engine.config.schema import show
from pagedserve.handlers.errors import HandlerError

MAX_JSON_DEPTH = 64  # objects and arrays inside each other (a JSON schema of ~30 levels fits)


def decode_json_body(raw: Any, max_bytes: int | None = None) -> dict[str, Any]:
    """Bytes, text or an already decoded object -> a JSON object (dict), else HandlerError:
    413 over `max_bytes`, 400 for anything else, naming the field when one is at fault."""
    if isinstance(raw, str):
        raw = raw.encode("utf-8", "surrogatepass")
    if isinstance(raw, (bytes, bytearray, memoryview)):
        if max_bytes is not None and len(raw) > max_bytes:
            raise HandlerError(f"the request body has {len(raw)} bytes; at most {max_bytes} are accepted", code=413)
        try:
            data = msgspec.json.decode(raw)
        except (msgspec.DecodeError, msgspec.ValidationError, RecursionError):
            raise _why_not(bytes(raw)) from None
    else:
        data = raw
    if not isinstance(data, dict):
        raise HandlerError("the request body must be a JSON object")
    if _containers_may_exceed(raw, data):
        _check_depth(data, "", 1)
    return data


def _containers_may_exceed(raw: Any, data: Any) -> bool:
    """Cheap pre-check: a body with few brackets cannot nest deeply."""
    if isinstance(raw, (bytes, bytearray)):
        return raw.count(b"[") + raw.count(b"{") > MAX_JSON_DEPTH
    return True


def _check_depth(value: Any, path: str, depth: int) -> None:
    if depth > MAX_JSON_DEPTH:
        raise _too_deep(path)
    if isinstance(value, dict):
        for key, item in value.items():
            if isinstance(item, (dict, list)):
                _check_depth(item, _join(path, key), depth + 1)
    elif isinstance(value, list):
        for i, item in enumerate(value):
            if isinstance(item, (dict, list)):
                _check_depth(item, f"{path}[{i}]", depth + 1)


def _why_not(raw: bytes) -> HandlerError:
    """The reason msgspec refused the body, found by Python's more lenient parser."""
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as exc:
        return HandlerError(f"the request body is not UTF-8 (byte {exc.start})")
    try:
        data = json.loads(text)
    except RecursionError:
        return _too_deep("")
    except json.JSONDecodeError as exc:
        return HandlerError(f"the request body is not valid JSON: {exc}")
    except ValueError:  # an integer of more digits than Python converts (sys.get_int_max_str_digits)
        return HandlerError(f"the request body has a number of more than {sys.get_int_max_str_digits()} digits")
    try:
        problem = _find_unrepresentable(data, "", 1)
    except RecursionError:
        return _too_deep("")
    return problem or HandlerError("the request body is not valid JSON")


def _find_unrepresentable(value: Any, path: str, depth: int) -> HandlerError | None:
    """The first string with a lone surrogate or number that is not finite, or too deep a nest."""
    if depth > MAX_JSON_DEPTH:
        return _too_deep(path)
    if isinstance(value, str):
        return _surrogate(value, path)
    if isinstance(value, float) and not math.isfinite(value):
        return HandlerError(f"{path or 'body'}: must be a finite number, got {show(value)}", param=path or None)
    items = value.items() if isinstance(value, dict) else enumerate(value) if isinstance(value, list) else ()
    for key, item in items:
        if isinstance(key, str) and (bad := _surrogate(key, path)):
            return bad
        found = _find_unrepresentable(item, f"{path}[{key}]" if isinstance(key, int) else _join(path, key), depth + 1)
        if found is not None:
            return found
    return None


def _surrogate(text: str, path: str) -> HandlerError | None:
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as exc:
        char = ascii(text[exc.start])[1:-1]
        return HandlerError(
            f"{path or 'body'}: contains a lone surrogate ({char}), which is not valid Unicode", param=path or None
        )
    return None


def _too_deep(path: str) -> HandlerError:
    field = path.split(".")[0].split("[")[0] or None  # the top-level field it is under
    where = f" (in {field})" if field else ""
    return HandlerError(
        f"the request body nests objects and arrays more than {MAX_JSON_DEPTH} deep{where}", param=field
    )


def _join(path: str, key: str) -> str:
    return f"{path}.{key}" if path else key
