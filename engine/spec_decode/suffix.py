"""The suffix decoding drafter: a suffix trie per request over its prompt and output, plus a
global one per model (base or LoRA adapter) over the outputs of recently finished requests,
bounded in tokens (oldest outputs evicted first). A proposal follows the likeliest
continuation of the longest matching suffix in each trie and keeps the one with the higher
score (expected kept tokens).

Per-request tries are indexed lazily: tokens are only added when a proposal is asked for, so
a request the adaptive controller does not draft for (large batches) costs nothing, and one
asked with an n-gram `lookup` (auto, until a draft of the request was kept) costs no indexing.

The engine core calls it from its one stepping thread; requests are keyed by id, so
interleaved requests never see each other's tokens except through the global trie, which
changes only when a request ends (`release`).
"""

from __future__ import annotations

from collections import deque
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field

from pagedserve.engine.spec_decode.ngram import NgramProposer
from pagedserve.engine.spec_decode.suffix_trie import Draft, SuffixTrie


@dataclass(slots=True)
class _RequestIndex:
    trie: SuffixTrie
    num_prompt: int
    model_key: str
    tokens: list[int] = field(default_factory=list)  # every token seen (indexed or not)
    active: list = field(default_factory=list)  # the trie's open suffixes after tokens[:indexed]
    indexed: int = 0


@dataclass(slots=True)
class SuffixStats:
    num_requests: int  # per-request tries alive
    request_nodes: int
    global_sequences: int
    global_tokens: int
    global_nodes: int
    global_bytes: int  # upper bound (SuffixTrie.memory_bytes)
    request_bytes: int


class SuffixProposer:
    def __init__(
        self,
        num_tokens: int,
        max_depth: int = 24,
        global_tokens: int = 16384,
        min_prob: float = 0.1,
        spec_factor: float = 1.0,
    ) -> None:
        self.num_tokens = num_tokens
        self.max_depth = max_depth
        self.global_tokens = global_tokens
        self.min_prob = min_prob
        self.spec_factor = spec_factor
        self._requests: dict[str, _RequestIndex] = {}
        self._global: dict[str, SuffixTrie] = {}  # model key ("" = base model) -> trie
        self._global_fifo: deque[tuple[str, list[int]]] = deque()
        self._global_size = 0

    # -- requests ------------------------------------------------------------------------
    def update(self, req_id: str, token_ids: Sequence[int], num_prompt: int, model_key: str = "") -> None:
        """Note the request's tokens (prompt and output so far); cheap: indexing waits for
        `propose`."""
        index = self._requests.get(req_id)
        if index is None:
            trie = SuffixTrie(self.max_depth)
            index = self._requests[req_id] = _RequestIndex(trie, num_prompt, model_key, active=trie.open())
        if len(token_ids) > len(index.tokens):
            index.tokens.extend(token_ids[len(index.tokens) :])

    def propose(self, req_id: str, max_tokens: int | None = None, lookup: NgramProposer | None = None) -> Draft:
        """The better of the request's own and the global trie's drafts (by score), at most
        `min(num_tokens, max_tokens)` tokens. `update` must have been called for the request.
        `lookup`: the request's own draft comes from this n-gram lookup instead of its trie,
        which stays unindexed (indexing costs ~24 node updates per token: `auto` pays for it
        only for requests whose drafts were kept)."""
        k = self.num_tokens if max_tokens is None else min(self.num_tokens, max_tokens)
        index = self._requests[req_id]
        if k < 1 or not index.tokens:
            return Draft([], [])
        context = index.tokens
        if lookup is not None:
            tokens = lookup.propose(context, k)
            best = Draft(tokens, [1.0] * len(tokens), lookup.min_n if tokens else 0)
        else:
            self._catch_up(index)
            # The open suffixes are the context's own suffix nodes: the longest with a child
            # is the local match, no search needed.
            match = next(
                ((node, depth) for depth, node in reversed(list(enumerate(index.active))) if node.children),
                (index.trie.root, 0),
            )
            best = index.trie.propose(context, k, self.min_prob, self.spec_factor, match)
        shared = self._global.get(index.model_key)
        if shared is not None and shared.num_nodes > 1:
            other = shared.propose(context[-self.max_depth :], k, self.min_prob, self.spec_factor)
            if other.score > best.score:
                best = other
        return best

    def _catch_up(self, index: _RequestIndex) -> None:
        trie, active = index.trie, index.active
        for token in index.tokens[index.indexed :]:
            active = trie.extend(active, token)
        index.active, index.indexed = active, len(index.tokens)

    def release(self, req_ids: Iterable[str]) -> None:
        """Forget requests that ended; their outputs go into their model's global trie."""
        for req_id in req_ids:
            index = self._requests.pop(req_id, None)
            if index is not None:
                self._remember(index.model_key, index.tokens[index.num_prompt :])

    def live_requests(self) -> Iterable[str]:
        return self._requests.keys()

    # -- the global trie -------------------------------------------------------------------
    def _remember(self, model_key: str, output: list[int]) -> None:
        if self.global_tokens == 0 or len(output) < 2:
            return
        output = output[-self.global_tokens :]
        while self._global_size + len(output) > self.global_tokens:
            key, old = self._global_fifo.popleft()
            self._global[key].remove(old)
            self._global_size -= len(old)
            if self._global[key].num_nodes == 1:
                del self._global[key]
        trie = self._global.get(model_key)
        if trie is None:
            trie = self._global[model_key] = SuffixTrie(self.max_depth)
        trie.add(output)
        self._global_fifo.append((model_key, output))
        self._global_size += len(output)

    def stats(self) -> SuffixStats:
        request_nodes = sum(i.trie.num_nodes for i in self._requests.values())
        global_nodes = sum(t.num_nodes for t in self._global.values())
        return SuffixStats(
            num_requests=len(self._requests),
            request_nodes=request_nodes,
            global_sequences=len(self._global_fifo),
            global_tokens=self._global_size,
            global_nodes=global_nodes,
            global_bytes=sum(t.memory_bytes() for t in self._global.values()),
            request_bytes=sum(i.trie.memory_bytes() for i in self._requests.values()),
        )
