"""A depth-bounded suffix trie with counts: every substring of at most `max_depth` tokens of
the sequences added is a path from the root, and each node counts its substring's occurrences.

This is the data structure of suffix decoding (Arctic Inference's SuffixDecoding, vLLM's
`suffix` method): the longest suffix of a request's tokens found in the trie is followed by
its most frequent continuation, each token's probability estimated from the counts.

Invariants: a node's count is the number of start positions of its substring in the
sequences added (minus those removed); the counts of a node's children sum to at most its
own; a node whose count falls to 0 is cut from its parent (its whole subtree is 0 too).
"""

from __future__ import annotations

import sys
from collections.abc import Sequence
from dataclasses import dataclass


class _Node:
    __slots__ = ("children", "count", "stamp")

    def __init__(self) -> None:
        self.children: dict[int, _Node] | None = None  # None for a leaf (saves a dict per leaf)
        self.count = 0
        self.stamp = 0  # when the node was last counted: the most recent occurrence wins ties


@dataclass(slots=True)
class Draft:
    """Proposed tokens; `probs[i]`: the estimated probability that tokens 0..i are all right.
    `score` = sum(probs), the number of tokens expected to be kept."""

    tokens: list[int]
    probs: list[float]
    match_len: int = 0

    @property
    def score(self) -> float:
        return sum(self.probs)


class SuffixTrie:
    def __init__(self, max_depth: int) -> None:
        if max_depth < 2:
            raise ValueError(f"max_depth must be >= 2, got {max_depth}")
        self.max_depth = max_depth
        self.root = _Node()
        self.num_nodes = 1
        self.clock = 0

    # -- adding and removing ---------------------------------------------------------------
    def open(self) -> list[_Node]:
        """The open suffixes of an empty sequence: `extend` grows them token by token."""
        return [self.root]

    def extend(self, active: list[_Node], token: int) -> list[_Node]:
        """Append `token` to a sequence whose open suffixes are `active` (active[j]: the node of
        its last j tokens, j < max_depth); returns the new open suffixes. O(max_depth)."""
        self.clock += 1
        out = [self.root]
        for node in active[: self.max_depth]:
            children = node.children
            if children is None:
                children = node.children = {}
            child = children.get(token)
            if child is None:
                child = children[token] = _Node()
                self.num_nodes += 1
            child.count += 1
            child.stamp = self.clock
            out.append(child)
        if len(out) > self.max_depth:  # a node at max_depth has no continuation to open
            out.pop()
        return out

    def add(self, tokens: Sequence[int]) -> None:
        active = self.open()
        for token in tokens:
            active = self.extend(active, token)

    def remove(self, tokens: Sequence[int]) -> None:
        """Take back a sequence given to `add` earlier (every suffix path loses one count)."""
        for start in range(len(tokens)):
            node = self.root
            for token in tokens[start : start + self.max_depth]:
                assert node.children is not None  # `add` counted this path
                child = node.children[token]
                child.count -= 1
                if child.count == 0:
                    del node.children[token]
                    self.num_nodes -= _size(child)
                    break
                node = child

    # -- looking up ------------------------------------------------------------------------
    def longest_match(self, context: Sequence[int]) -> tuple[_Node, int]:
        """The node of the longest suffix of `context` (< max_depth tokens) that has been seen
        followed by some token, and its length. Binary search: if a suffix of length p has a
        continuation, so has the one of length p - 1."""
        lo, hi, best = 0, min(len(context), self.max_depth - 1), self.root
        while lo < hi:
            mid = (lo + hi + 1) // 2
            node = self._walk(context[len(context) - mid :])
            if node is not None and node.children:
                lo, best = mid, node
            else:
                hi = mid - 1
        return best, lo

    def _walk(self, tokens: Sequence[int]) -> _Node | None:
        node: _Node | None = self.root
        for token in tokens:
            if node is None or not node.children:
                return None
            node = node.children.get(token)
        return node

    def follow(self, node: _Node, max_tokens: int, min_prob: float, prob: float = 1.0) -> Draft:
        """From `node`, the likeliest continuation (most counted child, the most recent on a
        tie) while the product of the children's shares stays >= `min_prob`."""
        tokens: list[int] = []
        probs: list[float] = []
        while len(tokens) < max_tokens and node.children:
            total = 0
            best_token, best = -1, None
            for token, child in node.children.items():
                total += child.count
                if best is None or (child.count, child.stamp) > (best.count, best.stamp):
                    best_token, best = token, child
            assert best is not None  # node.children is not empty
            prob *= best.count / total
            if prob < min_prob:
                break
            tokens.append(best_token)
            probs.append(prob)
            node = best
        return Draft(tokens, probs)

    def propose(
        self,
        context: Sequence[int],
        max_tokens: int,
        min_prob: float,
        spec_factor: float,
        match: tuple[_Node, int] | None = None,
    ) -> Draft:
        """Draft up to `max_tokens` tokens after `context`: match its longest suffix, follow the
        likeliest path; where the path ends at max_depth, match again with the drafts appended.
        At most `spec_factor` x the first match's length tokens (a 1-token match drafts 1).
        `match`: the first match when the caller knows it already."""
        node, match_len = match if match is not None else self.longest_match(context)
        limit = min(max_tokens, int(spec_factor * match_len))
        draft = Draft([], [], match_len)
        prob = 1.0
        while match_len and len(draft.tokens) < limit:
            step = self.follow(node, limit - len(draft.tokens), min_prob, prob)
            if not step.tokens:
                break
            draft.tokens += step.tokens
            draft.probs += step.probs
            prob = step.probs[-1]
            node, match_len = self.longest_match(list(context[-self.max_depth :]) + draft.tokens)
        return draft

    def memory_bytes(self) -> int:
        """An upper bound of the memory the nodes hold: each counted as a node object plus a
        one-entry dict (leaves hold no dict, a wide node holds a bigger one: rare in text)."""
        return self.num_nodes * NODE_BYTES


NODE_BYTES = sys.getsizeof(_Node()) + sys.getsizeof({0: None})


def _size(node: _Node) -> int:
    """Nodes in the subtree of `node` (itself included)."""
    stack, n = [node], 0
    while stack:
        current = stack.pop()
        n += 1
        if current.children:
            stack.extend(current.children.values())
    return n
