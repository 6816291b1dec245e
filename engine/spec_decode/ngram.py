"""The n-gram (prompt lookup) drafter: proposes what followed the last n tokens the last time
they appeared in the request's own tokens (prompt and output). No model, no state."""

from __future__ import annotations

import numpy as np
from numpy.lib.stride_tricks import sliding_window_view

from pagedserve.engine.sampling.params import SamplingParams


def can_draft(params: SamplingParams) -> bool:
    """Whether a request's tokens may be drafted and verified in one pass: verification samples
    every position with the request's plain sampling settings (and its grammar's mask for that
    position), so settings that depend on the position's history or report per-position extras
    decode one token at a time."""
    return not params.has_penalties and params.logprobs is None and params.min_tokens == 0


class NgramProposer:
    def __init__(self, num_tokens: int, min_n: int, max_n: int) -> None:
        self.num_tokens = num_tokens
        self.min_n = min_n
        self.max_n = max_n

    def propose(self, token_ids: list[int], max_tokens: int | None = None) -> list[int]:
        """Up to `min(num_tokens, max_tokens)` draft tokens, or [] when no n-gram recurs.

        Longer n-grams are tried first; among the earlier occurrences of one, the most recent
        with tokens after it wins.
        """
        k = self.num_tokens if max_tokens is None else min(self.num_tokens, max_tokens)
        if k < 1 or len(token_ids) < self.min_n + 1:
            return []
        tokens = np.asarray(token_ids, dtype=np.int64)
        for n in range(min(self.max_n, len(tokens) - 1), self.min_n - 1, -1):
            pattern = tokens[-n:]
            windows = sliding_window_view(tokens[:-1], n)  # every n-gram that has a token after it
            hits = np.flatnonzero((windows == pattern).all(axis=1))
            if hits.size:
                start = int(hits[-1]) + n
                return tokens[start : start + k].tolist()
        return []
