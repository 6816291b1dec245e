"""Incremental detokenization of generated tokens, with stop strings and safe streaming deltas.

Text is decoded the vLLM way: each new token decodes a small window of the output tokens
(``prefix_offset`` .. end) and the text of ``prefix_offset .. read_offset`` is cut off the front,
so the cost per token does not grow with the sequence length, and tokenizer quirks that depend on
the neighbouring token (sentencepiece leading spaces, byte-fallback pieces) come out as in a full
``decode``. The window starts on the last few prompt tokens, so the first generated token is
decoded in context too: a sentencepiece "▁Paris" after a prompt gives " Paris", as in
``decode(prompt + output)``, where alone it would lose its space. Offsets only move when the
window decodes to complete characters, so ``read_offset`` always sits on a character boundary
and the decoded text is the concatenation of the windows.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from pagedserve.engine.request.stop_strings import StopStrings

_REPLACEMENT_CHAR = "\ufffd"
PROMPT_CONTEXT_TOKENS = 5  # prompt tokens the first window starts with (vLLM uses 5 too)


@dataclass(slots=True)
class _DecodeState:
    """Where the decode window stands within the output tokens."""

    # Offsets index the window sequence: prompt context tokens, then the output tokens.
    prefix_offset: int = 0  # first token of the window (context for the read text)
    read_offset: int = 0  # first token whose text is not yet in ``text``
    text: str = ""  # decoded text of output[:read_offset] (complete characters only)


@dataclass(slots=True)
class _StopState:
    """What is known about stop strings and what has been streamed."""

    end: int | None = None  # len(output_text) once a stop matched
    sent: int = 0  # characters of output text already returned by get_next_delta
    finished: bool = False


class IncrementalDetokenizer:
    """Turn generated token ids into text one step at a time and detect stop strings.

    ``output_text`` is what the output tokens add to the decoded prompt, i.e.
    ``decode(prompt + output)`` less ``decode(prompt)`` (complete characters only until
    ``finish()``), cut right before a matched stop string (or right after it with
    ``include_stop_str_in_output``). Stop strings are searched in the generated text only;
    ``prompt_token_ids`` are kept for the caller but never enter the output text.
    """

    def __init__(
        self,
        tokenizer: Any,
        prompt_token_ids: Sequence[int],
        *,
        skip_special_tokens: bool = True,
        stop: Sequence[str] = (),
        include_stop_str_in_output: bool = False,
    ) -> None:
        self._stops = StopStrings(stop)  # checks them: non-empty strings
        self._tokenizer = tokenizer
        self.prompt_token_ids = list(prompt_token_ids)
        self.skip_special_tokens = skip_special_tokens
        self.include_stop_str_in_output = include_stop_str_in_output
        self._ids: list[int] = []
        context = self.prompt_token_ids[-PROMPT_CONTEXT_TOKENS:]
        if context and self._decode_ids(context).endswith(_REPLACEMENT_CHAR):
            context = []  # the prompt ends inside a character: no clean cut after it
        self._seq: list[int] = list(context)  # context + output tokens: what windows index
        self._decode = _DecodeState(read_offset=len(context))
        self._stop = _StopState()

    # -- public state ------------------------------------------------------------------------

    @property
    def output_token_ids(self) -> list[int]:
        """All generated token ids given to ``update`` (not cut at a stop string)."""
        return self._ids

    @property
    def output_text(self) -> str:
        """Generated text so far, truncated at a matched stop string."""
        text = self._decode.text
        return text if self._stop.end is None else text[: self._stop.end]

    @property
    def finished(self) -> bool:
        """True after ``finish()`` or once a stop string matched."""
        return self._stop.finished

    # -- updates -----------------------------------------------------------------------------

    def update(self, new_token_ids: Sequence[int]) -> str | None:
        """Append generated tokens; return the stop string that matched, else None."""
        if self._stop.finished:
            raise RuntimeError("update() called on a finished detokenizer")
        start = len(self._decode.text)
        for token_id in new_token_ids:
            self._ids.append(token_id)
            self._seq.append(token_id)
            self._decode_step(flush=False)
        return self._check_stop(start)

    def finish(self) -> None:
        """Mark the output complete: flush an incomplete trailing character, release held text."""
        if self._stop.finished:
            return
        start = len(self._decode.text)
        self._decode_step(flush=True)
        self._check_stop(start)
        self._stop.finished = True

    def get_next_delta(self) -> str:
        """Return output text not returned before, holding back what may still change.

        Until finished, a suffix that is a prefix of some stop string is held back (it may
        become a stop string that must not be shown); incomplete characters are never in the
        text before ``finish()``.
        """
        text = self.output_text
        end = len(text)
        if not self._stop.finished:
            end -= self._stops.held_back(text)
        end = max(end, self._stop.sent)
        delta = text[self._stop.sent : end]
        self._stop.sent = end
        return delta

    # -- internals ---------------------------------------------------------------------------

    def _decode_ids(self, ids: list[int]) -> str:
        return self._tokenizer.decode(
            ids,
            skip_special_tokens=self.skip_special_tokens,
            clean_up_tokenization_spaces=False,
        )

    def _decode_step(self, *, flush: bool) -> None:
        """Decode the window after the last token; advance offsets on complete characters."""
        state = self._decode
        seq = self._seq
        if state.read_offset == len(seq):
            return
        prefix_text = self._decode_ids(seq[state.prefix_offset : state.read_offset])
        full_text = self._decode_ids(seq[state.prefix_offset :])
        # An incomplete UTF-8 sequence at the end decodes to U+FFFD: wait for more tokens.
        if len(full_text) <= len(prefix_text) or (full_text.endswith(_REPLACEMENT_CHAR) and not flush):
            return
        state.text += full_text[len(prefix_text) :]
        state.prefix_offset = state.read_offset
        state.read_offset = len(seq)

    def _check_stop(self, start: int) -> str | None:
        """Search stop strings in text appended after ``start`` (plus an overlap before it)."""
        found = self._stops.find(self._decode.text, start)
        if found is None:
            return None
        idx, s = found
        stop = self._stop
        stop.end = idx + len(s) if self.include_stop_str_in_output else idx
        stop.finished = True
        return s
