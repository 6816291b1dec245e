"""Why a request's prompt blocks were not reused from the prefix cache.

A request reuses the longest run of cached blocks from its start; its first block outside the
cache ends the run, and the cause reported is that block's (the blocks after it cannot be
reused whatever they hold). The blocks are told apart by their *content hash*: the hash chain
of the tokens alone, without the extra keys (LoRA adapter, cache salt) that make the prefix
cache's own hashes differ between tenants and adapters. For a request without extra keys it is
its block hash itself, so nothing more is computed for the usual request.

`MissTracker` remembers, for the most recently published blocks (a bounded LRU of twice the
pool's blocks), which extra keys each content was computed under. A missed block is then:

- `first_seen`: its content was never published (or was forgotten since);
- `evicted`: it was published under the same keys, and its memory was given to another block
  (or the prefix cache was reset) since;
- `lora_differs` / `salt_differs`: the content is known only under another adapter / another
  cache salt (the cache keeps tenants and adapters apart on purpose);
- `group_not_cached`: the request's KV-cache group keeps no blocks for reuse (prefix caching
  off for the group; with hybrid models, a group whose blocks are not kept).
"""

from __future__ import annotations

import enum
from collections import OrderedDict
from dataclasses import dataclass

from pagedserve.engine.kv_cache.hashing import BlockHash

# How many extra-key variants are remembered per content (tenants sharing one prompt).
_KEYS_PER_CONTENT = 4


class MissCause(enum.Enum):
    FIRST_SEEN = "first_seen"
    EVICTED = "evicted"
    SALT_DIFFERS = "salt_differs"
    LORA_DIFFERS = "lora_differs"
    GROUP_NOT_CACHED = "group_not_cached"


@dataclass(frozen=True, slots=True)
class PrefixMiss:
    """A request's prefix-cache miss: the cause of its first missed block and how many prompt
    tokens in full blocks (those the cache could have served) were not served."""

    cause: MissCause
    num_tokens: int


# (LoRA adapter id, cache salt): `Request.extra_keys`, or None for neither.
ExtraKeys = tuple[object, ...] | None


def _lora(keys: ExtraKeys) -> object:
    return None if keys is None else keys[0]


class MissTracker:
    """The contents published recently and the extra keys each was published under."""

    def __init__(self, capacity: int) -> None:
        if capacity < 1:
            raise ValueError(f"capacity must be >= 1, got {capacity}")
        self.capacity = capacity
        self._seen: OrderedDict[BlockHash, tuple[ExtraKeys, ...]] = OrderedDict()

    def record(self, content_hash: BlockHash, keys: ExtraKeys) -> None:
        """A block of this content was published under `keys`."""
        known = self._seen.pop(content_hash, ())
        if keys not in known:
            known = (*known, keys)[-_KEYS_PER_CONTENT:]
        self._seen[content_hash] = known
        if len(self._seen) > self.capacity:
            self._seen.popitem(last=False)

    def classify(self, content_hash: BlockHash, keys: ExtraKeys) -> MissCause:
        """The cause of a miss on a block of this content, requested under `keys`."""
        known = self._seen.get(content_hash)
        if not known:
            return MissCause.FIRST_SEEN
        if keys in known:
            return MissCause.EVICTED
        if any(_lora(k) == _lora(keys) for k in known):
            return MissCause.SALT_DIFFERS
        return MissCause.LORA_DIFFERS
