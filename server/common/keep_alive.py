"""The per-request `keep_alive` field (on /predictions and the OpenAI routes), Ollama's way.

A duration: seconds as a number, or a string of numbers with units (`"30s"`, `"5m"`,
`"1h30m"`, `"250ms"`; a bare number in a string is seconds). `0` unloads the version right after
the request (once nothing else is in flight), a negative value keeps it loaded until told
otherwise. It only affects versions with minWorkers 0 (loaded on demand); see pagedserve.server.workers.lifecycle.
"""

from __future__ import annotations

import math
import re
from typing import Any

MAX_KEEP_ALIVE_S = 7 * 86_400.0
_UNITS = {"ms": 0.001, "s": 1.0, "m": 60.0, "h": 3600.0}
_PART = re.compile(r"(\d+(?:\.\d+)?)(ms|s|m|h)")
FIELD = "keep_alive"


class KeepAliveError(ValueError):
    """A keep_alive value that is not a duration (400 naming the field)."""

    field = FIELD


def parse_keep_alive(value: Any) -> float:
    """Seconds (negative: forever) from a request's keep_alive value; KeepAliveError otherwise."""
    if isinstance(value, bool) or not isinstance(value, (int, float, str)):
        raise KeepAliveError(
            f"{FIELD}: must be a duration (seconds, or a string such as \"5m\"), got {type(value).__name__}"
        )
    if isinstance(value, str):
        seconds = _parse_text(value.strip())
    else:
        seconds = float(value)
    if not math.isfinite(seconds):
        raise KeepAliveError(f"{FIELD}: must be finite, got {value!r}")
    if seconds < 0:
        return -1.0
    if seconds > MAX_KEEP_ALIVE_S:
        raise KeepAliveError(
            f"{FIELD}: must be at most {MAX_KEEP_ALIVE_S:g} seconds (or negative: forever), got {value!r}"
        )
    return seconds


def _parse_text(text: str) -> float:
    sign = -1.0 if text.startswith("-") else 1.0
    body = text[1:] if sign < 0 else text
    try:
        return sign * float(body)
    except ValueError:
        pass
    if not body or _PART.sub("", body):
        shown = text if len(text) <= 40 else text[:37] + "..."
        raise KeepAliveError(
            f"{FIELD}: {shown!r} is not a duration; use seconds or units ms, s, "
            "m, h (e.g. \"30s\", \"5m\", \"1h30m\", \"-1\" for forever)"
        )
    return sign * sum(float(n) * _UNITS[unit] for n, unit in _PART.findall(body))


def take_keep_alive(body: Any) -> float | None:
    """Remove `keep_alive` from a JSON request body (the routes' own declarations do not know
    it) and return it in seconds; None when absent."""
    if not isinstance(body, dict) or FIELD not in body:
        return None
    return parse_keep_alive(body.pop(FIELD))
