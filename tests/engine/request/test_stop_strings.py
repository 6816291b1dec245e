"""StopStrings: the same answers as the obvious search, in work bounded by the longest stop string.

Work is counted, not timed: a profile hook counts the calls one `held_back` makes (Python and
C functions) and fails the test once they pass a budget proportional to the longest stop string.
Trying every prefix length of every stop string (the search this replaced) makes
count x max_len calls for one chunk and trips the budget at once.
"""

from __future__ import annotations

import contextlib
import random
import sys

import pytest

from pagedserve.engine.request.stop_strings import StopStrings


def reference_held_back(text: str, stop: list[str]) -> int:
    """Longest suffix of `text` that is a proper prefix of some stop string, the obvious way."""
    return max((k for s in stop for k in range(1, len(s)) if text.endswith(s[:k])), default=0)


def reference_find(text: str, start: int, stop: list[str]) -> tuple[int, str] | None:
    """Earliest stop string ending after `start` (first listed on a tie), the obvious way."""
    best = None
    for s in stop:
        idx = text.find(s)
        while idx != -1 and idx + len(s) <= start:
            idx = text.find(s, idx + 1)
        if idx != -1 and (best is None or idx < best[0]):
            best = (idx, s)
    return best


class BudgetExceeded(Exception):
    pass


@contextlib.contextmanager
def call_budget(limit: int):
    """Raise BudgetExceeded inside the block once it has made more than `limit` calls."""
    calls = 0

    def hook(frame, event, arg):
        nonlocal calls
        if event in ("call", "c_call"):
            calls += 1
            if calls > limit:
                raise BudgetExceeded(f"more than {limit} calls")

    sys.setprofile(hook)
    try:
        yield
    finally:
        sys.setprofile(None)


def test_held_back_and_find_match_the_obvious_search():
    rng = random.Random(11)
    for _ in range(3000):
        alphabet = "ab" if rng.random() < 0.5 else "abc\n"
        stop = ["".join(rng.choice(alphabet) for _ in range(rng.randint(1, 6))) for _ in range(rng.randint(1, 5))]
        text = "".join(rng.choice(alphabet) for _ in range(rng.randint(0, 20)))
        matcher = StopStrings(stop)
        assert matcher.held_back(text) == reference_held_back(text, stop), (text, stop)
        start = rng.randint(0, len(text))
        assert matcher.find(text, start) == reference_find(text, start, stop), (text, start, stop)


def test_held_back_examples():
    assert StopStrings(["END"]).held_back("abc EN") == 2 and StopStrings(["END"]).held_back("abc") == 0
    assert StopStrings(["ab", "abc"]).held_back("xab") == 2  # a whole stop string and a prefix of "abc"
    assert StopStrings(["ab"]).held_back("xab") == 0  # only whole: the detokenizer has stopped already
    assert StopStrings(["]x", "-]y"]).held_back("a-]") == 2  # characters special in a regex class
    assert StopStrings([]).held_back("anything") == 0 and not StopStrings([])
    with pytest.raises(ValueError, match="non-empty strings"):
        StopStrings(["ok", ""])


@pytest.mark.parametrize("count", [300, 3000])
def test_held_back_work_does_not_grow_with_the_number_of_stop_strings(count):
    """3,000 stop strings of 2,000 characters (the attack): every position of the tail could
    start one and only the last does (every stop string starts with "a"), the worst case for
    the search. One chunk's check stays within a budget of a few calls per tail position."""
    stop = [f"a{i:05d}" + "x" * 1994 for i in range(count)]
    matcher = StopStrings(stop)
    text = "a" * 4000
    with call_budget(10 * matcher.max_len):
        assert matcher.held_back(text) == 1
    with call_budget(10 * matcher.max_len):
        assert matcher.held_back(text + "a00000" + "x" * 5) == 11


def test_the_budget_catches_the_search_it_replaced():
    """The budget is tight enough to fail the quadratic search (so the test above can fail)."""
    stop = [f"a{i:05d}" + "x" * 1994 for i in range(300)]
    with pytest.raises(BudgetExceeded), call_budget(10 * 2000):
        reference_held_back("a" * 4000, stop)
