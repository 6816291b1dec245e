"""Which ready worker of a model version gets a request: least loaded, or prefix-affine.

`least_loaded` (the default) sends each request to the worker with the fewest requests
unfinished, then the fewest KV blocks in use; equal loads take turns. `prefix_affinity` first
looks for the worker that last received the longest run of this prompt's leading blocks: that
worker's prefix cache most likely still holds them, so the prompt is not recomputed. The
front end cannot see the workers' caches; it remembers, per block-aligned prefix, where it sent
it (a chained hash of up to `MAX_BLOCKS` leading blocks, in an LRU map of at most `capacity`
entries). Affinity is balanced against load: the affine worker is taken only while it has at
most `max_imbalance` more requests unfinished than the least loaded worker; otherwise the least
loaded one wins and the prefix is remembered there. A worker that restarted keeps its name, so
stale entries route to a cold cache once, which then warms again: a miss costs a recompute,
never an error.
"""

from __future__ import annotations

import enum
from collections import Counter, OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from pagedserve.engine.core.async_llm import AsyncLLM

MAX_BLOCKS = 256  # leading blocks hashed per prompt (4,096 tokens at 16 tokens a block)
DEFAULT_CAPACITY = 65_536  # remembered prefixes per model version (a few MB)
DEFAULT_MAX_IMBALANCE = 4  # requests the affine worker may be above the least loaded one


class RoutingPolicy(str, enum.Enum):
    """model-config.yaml's `routing` key."""

    LEAST_LOADED = "least_loaded"
    PREFIX_AFFINITY = "prefix_affinity"


def load_key(engine: AsyncLLM) -> tuple[int, int]:
    """Requests unfinished, then KV blocks in use (lower is less loaded)."""
    stats = engine.stats
    used = (stats.num_kv_blocks - stats.num_free_blocks) if stats is not None else 0
    return engine.num_unfinished, used


def prefix_hashes(token_ids: Sequence[int], block_size: int, max_blocks: int = MAX_BLOCKS) -> list[int]:
    """One chained hash per full leading block: entry i identifies tokens [0, (i+1)*block_size).
    Python's tuple hash is enough: the keys live only in this process and a collision costs
    one misrouted request, not a wrong answer (the worker's own cache checks tokens)."""
    n = min(len(token_ids) // block_size, max_blocks)
    out: list[int] = []
    parent = 0
    for i in range(n):
        parent = hash((parent, tuple(token_ids[i * block_size : (i + 1) * block_size])))
        out.append(parent)
    return out


@dataclass(slots=True)
class Route:
    engine: AsyncLLM
    matched_blocks: int  # leading blocks remembered on the chosen worker (0: none / not affine)


@dataclass(slots=True, eq=False)
class Router:
    """Picks a worker for each request of one model version; its counters feed /metrics."""

    policy: RoutingPolicy = RoutingPolicy.LEAST_LOADED
    block_size: int = 16
    capacity: int = DEFAULT_CAPACITY
    max_imbalance: int = DEFAULT_MAX_IMBALANCE
    _owner: OrderedDict[int, str] = field(default_factory=OrderedDict)  # prefix hash -> worker name
    _turn: int = 0
    # per worker name: requests sent there because it held their prefix / blocks it held
    prefix_hits: Counter = field(default_factory=Counter)
    prefix_hit_blocks: Counter = field(default_factory=Counter)
    routed: Counter = field(default_factory=Counter)  # per worker name: requests routed

    def __post_init__(self) -> None:
        self.policy = RoutingPolicy(self.policy)
        if self.block_size < 1 or self.capacity < 1 or self.max_imbalance < 0:
            raise ValueError("routing: block_size and capacity must be >= 1, max_imbalance >= 0")

    def least_loaded(self, ready: list[AsyncLLM]) -> AsyncLLM:
        """The least loaded worker; equal loads take turns (the scan start rotates)."""
        self._turn = (self._turn + 1) % len(ready)
        rotated = ready[self._turn :] + ready[: self._turn]
        return min(rotated, key=load_key)

    def route(self, ready: list[AsyncLLM], token_ids: Sequence[int]) -> Route:
        """Choose among `ready` (non-empty) for a prompt of `token_ids`."""
        fallback = self.least_loaded(ready)
        if self.policy is RoutingPolicy.LEAST_LOADED or len(ready) == 1:
            self.routed[fallback.name] += 1
            return Route(fallback, 0)
        hashes = prefix_hashes(token_ids, self.block_size)
        by_name = {e.name: e for e in ready}
        best: AsyncLLM | None = None
        matched = 0
        # The deepest remembered prefix on a ready worker: a chained hash names its whole
        # prefix, so the worker that last got it was sent every block before it too.
        for i in range(len(hashes) - 1, -1, -1):
            name = self._owner.get(hashes[i])
            if name in by_name:
                best, matched = by_name[name], i + 1
                break
        chosen = fallback
        if best is not None and load_key(best)[0] - load_key(fallback)[0] <= self.max_imbalance:
            chosen = best
            self.prefix_hits[best.name] += 1
            self.prefix_hit_blocks[best.name] += matched
        else:
            matched = 0
        self._remember(hashes, chosen.name)
        self.routed[chosen.name] += 1
        return Route(chosen, matched)

    def _remember(self, hashes: list[int], name: str) -> None:
        owner = self._owner
        for h in hashes:
            owner[h] = name
            owner.move_to_end(h)
        while len(owner) > self.capacity:
            owner.popitem(last=False)

    def __len__(self) -> int:
        return len(self._owner)
