"""Cumulative engine outputs -> per-choice deltas for streaming.

The engine hands back a cumulative `RequestOutput` each time a request changes. A stream sends
only what is new. Text that may still turn into a stop string (a suffix of the text that is a
proper prefix of a stop string) is held back until it is settled, so a client never sees text
that the final answer does not contain: the streamed deltas concatenate to the final text.
The check looks only at the text's last characters (engine/request/stop_strings.py), so its cost per
chunk does not grow with the output or the number of stop strings.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

from pagedserve.engine.request.outputs import FinishReason, RequestOutput, TokenLogprob
from pagedserve.engine.request.stop_strings import StopStrings


@dataclass(slots=True)
class ChoiceDelta:
    """What one choice gained since the previous delta."""

    index: int
    text: str
    token_ids: list[int]
    logprobs: list[dict[int, TokenLogprob]] | None
    finish_reason: FinishReason | None = None
    stop_reason: int | str | None = None
    text_offset: int = 0  # characters of this choice's text sent before this delta
    error: str | None = None  # why the engine ended this choice early (with its finish_reason)


@dataclass(slots=True)
class _Sent:
    chars: int = 0
    tokens: int = 0
    logprobs: int = 0
    finished: bool = False


@dataclass(slots=True)
class DeltaTracker:
    """Remembers what was sent per choice; `update` returns the deltas of a new output."""

    stop: Sequence[str] | StopStrings = ()
    _sent: dict[int, _Sent] = field(default_factory=dict)

    def __post_init__(self) -> None:
        if not isinstance(self.stop, StopStrings):
            self.stop = StopStrings(self.stop)  # sorted once for the whole stream

    def update(self, out: RequestOutput) -> list[ChoiceDelta]:
        deltas = []
        for c in out.outputs:
            sent = self._sent.setdefault(c.index, _Sent())
            if sent.finished:
                continue
            finished = c.finish_reason is not None
            end = len(c.text) if finished else len(c.text) - held_back(c.text, self.stop)
            end = max(end, sent.chars)
            new_logprobs = None
            if c.logprobs is not None:
                new_logprobs = c.logprobs[sent.logprobs :]
            delta = ChoiceDelta(
                index=c.index,
                text=c.text[sent.chars : end],
                token_ids=c.token_ids[sent.tokens :],
                logprobs=new_logprobs,
                finish_reason=c.finish_reason,
                stop_reason=c.stop_reason,
                text_offset=sent.chars,
                error=c.error,
            )
            sent.chars, sent.tokens, sent.finished = end, len(c.token_ids), finished
            if c.logprobs is not None:
                sent.logprobs = len(c.logprobs)
            if delta.text or delta.token_ids or finished:
                deltas.append(delta)
        return deltas


def held_back(text: str, stop: Sequence[str] | StopStrings) -> int:
    """Length of the longest suffix of `text` that is a proper prefix of a stop string."""
    matcher = stop if isinstance(stop, StopStrings) else StopStrings(stop)
    return matcher.held_back(text)
