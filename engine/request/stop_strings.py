"""A request's stop strings, matched in bounded time per chunk of new text.

Two questions are asked after every chunk a request generates, by the detokenizer (has a stop
string appeared?) and by a stream (how much of the text's end may still become one, and must be
held back?). Both look only at the end of the text: a stop string that ends in the new text
starts at most ``max_len - 1`` characters before it, and a suffix that can still grow into a stop
string is shorter than ``max_len``. So the work per chunk depends on the new text and the longest
stop string, never on how long the output has grown:

- ``find`` searches each stop string in the new text plus an overlap of ``len(s) - 1`` characters
  (C-speed ``str.find``; ``count x (new + max_len)`` characters at worst);
- ``held_back`` visits only the positions of the last ``max_len - 1`` characters where some stop
  string could start (one regex scan for the possible first characters), and asks of each suffix
  whether it is a proper prefix of a stop string by one binary search in the sorted stop strings
  (strings that start with ``x`` sort right after ``x``): ``O(max_len * log(count))`` comparisons,
  where trying every prefix length of every stop string cost ``O(count * max_len**2)``.
"""

from __future__ import annotations

import bisect
import re
from collections.abc import Sequence


class StopStrings:
    """The stop strings of one request (non-empty strings, in the request's order)."""

    __slots__ = ("strings", "max_len", "_sorted", "_starts")

    def __init__(self, stop: Sequence[str] = ()) -> None:
        if isinstance(stop, str):
            stop = [stop]
        if any(not isinstance(s, str) or not s for s in stop):
            raise ValueError(f"stop strings must be non-empty strings, got {list(stop)!r}")
        self.strings: tuple[str, ...] = tuple(stop)
        self.max_len = max((len(s) for s in self.strings), default=0)
        self._sorted = sorted(set(self.strings))
        first_chars = sorted({s[0] for s in self.strings})
        # Where a stop string may start: one scan of the tail finds every candidate position.
        self._starts = re.compile("[" + "".join(re.escape(c) for c in first_chars) + "]") if first_chars else None

    def __bool__(self) -> bool:
        return bool(self.strings)

    def find(self, text: str, start: int) -> tuple[int, str] | None:
        """The earliest stop string that ends after ``text[start]`` began, as (index, string);
        on a tie, the one listed first. None when there is none."""
        best: tuple[int, str] | None = None
        for s in self.strings:
            idx = text.find(s, max(0, start - len(s) + 1))
            if idx != -1 and (best is None or idx < best[0]):
                best = (idx, s)
        return best

    def held_back(self, text: str) -> int:
        """Length of the longest suffix of ``text`` that is a proper prefix of a stop string:
        the text a stream must not send yet, since it may still turn into a stop string."""
        if self._starts is None:
            return 0
        end = len(text)
        # The leftmost candidate that works gives the longest suffix.
        for match in self._starts.finditer(text, max(0, end - self.max_len + 1)):
            if self._is_proper_prefix(text[match.start() :]):
                return end - match.start()
        return 0

    def _is_proper_prefix(self, x: str) -> bool:
        """True when some stop string is longer than ``x`` and starts with it."""
        i = bisect.bisect_left(self._sorted, x)
        if i < len(self._sorted) and self._sorted[i] == x:
            i += 1  # x itself is a stop string; a longer one that starts with x sorts next
        return i < len(self._sorted) and self._sorted[i].startswith(x)
