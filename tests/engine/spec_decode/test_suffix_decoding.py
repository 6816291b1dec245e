"""Suffix decoding: the depth-bounded suffix trie's exact counts and nodes, the drafter's exact
proposals on tiny sequences (local trie, global trie, scores, memory bound), and interleaved
requests kept apart."""

from __future__ import annotations

import pytest

from pagedserve.engine.spec_decode.suffix import SuffixProposer
from pagedserve.engine.spec_decode.suffix_trie import NODE_BYTES, SuffixTrie


def counts(trie: SuffixTrie) -> dict[tuple[int, ...], int]:
    """Every path from the root with its count."""
    out, stack = {}, [((), trie.root)]
    while stack:
        path, node = stack.pop()
        for token, child in (node.children or {}).items():
            out[(*path, token)] = child.count
            stack.append(((*path, token), child))
    return out


def test_trie_counts_every_substring_up_to_its_depth():
    trie = SuffixTrie(max_depth=3)
    trie.add([1, 2, 1, 2])
    assert counts(trie) == {(1,): 2, (2,): 2, (1, 2): 2, (2, 1): 1, (1, 2, 1): 1, (2, 1, 2): 1}
    assert trie.num_nodes == 7  # the root and six substrings
    assert trie.memory_bytes() == 7 * NODE_BYTES
    trie.add([2, 2])
    assert counts(trie)[(2,)] == 4 and counts(trie)[(2, 2)] == 1
    trie.remove([1, 2, 1, 2])
    assert counts(trie) == {(2,): 2, (2, 2): 1}
    assert trie.num_nodes == 3
    trie.remove([2, 2])
    assert trie.num_nodes == 1 and not trie.root.children


def test_longest_match_needs_a_continuation():
    trie = SuffixTrie(max_depth=4)
    trie.add([1, 2, 3, 9, 2, 3])
    node, length = trie.longest_match([5, 1, 2, 3])
    assert length == 3 and set(node.children) == {9}  # "1 2 3" was followed by 9
    node, length = trie.longest_match([7, 2, 3])
    assert length == 2 and set(node.children) == {9}  # "2 3" at the end has no continuation
    assert trie.longest_match([8])[1] == 0  # never seen: the root


def test_local_proposals_exact():
    p = SuffixProposer(num_tokens=4, max_depth=8)
    p.update("a", [1, 2, 3, 4, 5, 1, 2, 3], num_prompt=8)
    draft = p.propose("a")
    # "1 2 3" (3 tokens) matched: at most 3 drafts (spec_factor 1), each certain
    assert (draft.tokens, draft.probs, draft.match_len) == ([4, 5, 1], [1.0, 1.0, 1.0], 3)
    assert p.propose("a", max_tokens=2).tokens == [4, 5]
    assert p.propose("a", max_tokens=0).tokens == []
    p.update("a", [1, 2, 3, 4, 5, 1, 2, 3, 4], num_prompt=8)  # one more token: a longer match
    assert p.propose("a").tokens == [5, 1, 2, 3]


def test_probabilities_from_counts_and_the_most_recent_wins_a_tie():
    p = SuffixProposer(num_tokens=4, max_depth=8, min_prob=0.1)
    p.update("a", [5, 1, 5, 2, 5], num_prompt=5)
    draft = p.propose("a")  # "5" was followed once by 1, once (later) by 2
    assert (draft.tokens, draft.probs) == ([2], [0.5])
    strict = SuffixProposer(num_tokens=4, max_depth=8, min_prob=0.6)
    strict.update("a", [5, 1, 5, 2, 5], num_prompt=5)
    assert strict.propose("a").tokens == []  # 0.5 < min_prob
    counted = SuffixProposer(num_tokens=4, max_depth=8, spec_factor=4.0)
    counted.update("a", [5, 1, 5, 1, 5, 2, 5], num_prompt=7)
    draft = counted.propose("a")  # "5": followed by 1 twice, by 2 once
    assert draft.tokens[0] == 1 and draft.probs[0] == pytest.approx(2 / 3)


def test_drafts_continue_past_the_trie_depth():
    p = SuffixProposer(num_tokens=8, max_depth=3, spec_factor=8.0)
    p.update("a", [1, 2, 3, 4, 5, 6, 7, 1, 2], num_prompt=9)
    # match "1 2" (depth 2), follow to depth 3 ("1 2 3"), then match again "2 3" -> 4, ...
    assert p.propose("a").tokens == [3, 4, 5, 6, 7, 1, 2, 3]


def test_global_trie_serves_a_new_request_and_stays_bounded():
    p = SuffixProposer(num_tokens=4, max_depth=6, global_tokens=10, spec_factor=2.0)
    p.update("a", [100, 101, 10, 11, 12, 13, 14, 15], num_prompt=2)
    p.release(["a"])  # its 6 output tokens go to the global trie (prompt not stored)
    assert p.stats().global_tokens == 6 and p.stats().num_requests == 0
    p.update("b", [200, 201, 10, 11], num_prompt=4)
    draft = p.propose("b")  # nothing recurs inside b; the global trie knows "10 11" -> 12 13 14
    assert draft.tokens == [12, 13, 14, 15] and draft.match_len == 2
    p.update("c", [300, 10], num_prompt=2)
    p.release(["b", "c"])  # b stored nothing new (prompt only), c had no output
    assert p.stats().global_sequences == 1
    p.update("d", [1, 30, 31, 32, 33, 34], num_prompt=1)
    p.release(["d"])  # 5 more tokens: 11 > 10, the oldest output is evicted
    stats = p.stats()
    assert (stats.global_sequences, stats.global_tokens) == (1, 5)
    fresh = SuffixTrie(6)
    fresh.add([30, 31, 32, 33, 34])
    assert stats.global_nodes == fresh.num_nodes and stats.global_bytes == fresh.memory_bytes()
    p.update("e", [10, 11], num_prompt=2)
    assert p.propose("e").tokens == []  # the evicted output is gone


def test_global_tries_are_per_model():
    p = SuffixProposer(num_tokens=4, max_depth=6, spec_factor=2.0)
    p.update("a", [0, 10, 11, 12, 13], num_prompt=1, model_key="adapter-x")
    p.release(["a"])
    p.update("base", [10, 11], num_prompt=2)
    p.update("same", [10, 11], num_prompt=2, model_key="adapter-x")
    assert p.propose("base").tokens == []
    assert p.propose("same").tokens == [12, 13]


def test_interleaved_requests_keep_their_own_tries_and_index_lazily():
    p = SuffixProposer(num_tokens=3, max_depth=8)
    p.update("x", [1, 2, 3, 1, 2], num_prompt=3)
    p.update("y", [1, 2, 7, 1, 2], num_prompt=3)
    assert p.stats().request_nodes == 2  # nothing indexed before a proposal is asked for
    assert p.propose("x").tokens == [3, 1]
    assert p.propose("y").tokens == [7, 1]
    p.update("x", [1, 2, 3, 1, 2, 3], num_prompt=3)
    p.update("y", [1, 2, 7, 1, 2, 7], num_prompt=3)
    assert p.propose("y").tokens == [1, 2, 7]
    assert p.propose("x").tokens == [1, 2, 3]
    p.release(["x"])
    assert set(p.live_requests()) == {"y"}
