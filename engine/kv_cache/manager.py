"""Per-request KV block bookkeeping on top of the block pool: prefix hits, allocation, freeing,
over one or more KV cache groups (the hybrid KV cache: pagedserve.engine.kv_cache.groups)."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Protocol

from pagedserve.engine.kv_cache.block import KVCacheBlock
from pagedserve.engine.kv_cache.block_pool import BlockPool
from pagedserve.engine.kv_cache.group_manager import GroupManager, make_group_manager
from pagedserve.engine.kv_cache.groups import KVCacheGroupSpec
from pagedserve.engine.kv_cache.hashing import BlockHash, HashFn, hash_request_blocks
from pagedserve.engine.kv_cache.miss_causes import MissCause, MissTracker, PrefixMiss


class Request(Protocol):
    """What the KV manager reads of a request (pagedserve.engine.request.request.Request has it): the cache is
    below the request in the layering, so it names only these."""

    request_id: str
    num_computed_tokens: int
    block_hashes: list[BlockHash]

    @property
    def all_token_ids(self) -> Sequence[int]: ...
    @property
    def num_tokens(self) -> int: ...
    @property
    def extra_keys(self) -> tuple[object, ...] | None: ...


@dataclass(slots=True)
class KVCacheBlocks:
    """Blocks of one request, one list per KV cache group (the null block, id -1, where a
    sliding group no longer needs one)."""

    groups: tuple[list[KVCacheBlock], ...]

    def block_ids(self) -> tuple[list[int], ...]:
        return tuple([b.block_id for b in blocks] for blocks in self.groups)


class KVCacheManager:
    """Maps requests to their block lists, one per KV cache group, over one block pool.

    A full-attention group's list is append-only while the request runs; a sliding group also
    returns the blocks its window has left (`remove_skipped_blocks`). Freeing returns every
    block (in reverse order) at once. Without `groups`: one full-attention group."""

    def __init__(
        self,
        num_blocks: int,
        block_size: int,
        hash_fn: HashFn,
        enable_caching: bool = True,
        groups: Sequence[KVCacheGroupSpec] | None = None,
    ) -> None:
        self.block_size = block_size
        self.hash_fn = hash_fn
        self.enable_caching = enable_caching
        self.pool = BlockPool(num_blocks, enable_caching)
        # Stands for a block a sliding group no longer holds: never in the pool's lists.
        self.null_block = KVCacheBlock(-1)
        specs = groups or (KVCacheGroupSpec(None, ()),)
        self.groups: list[GroupManager] = [
            make_group_manager(g, spec.window, self.pool, self.null_block, block_size) for g, spec in enumerate(specs)
        ]
        # Full groups first when hits are searched: a sliding group's hit is then never longer.
        self._hit_order = sorted(self.groups, key=lambda m: m.window is not None)
        # Prefix-cache statistics over get_computed_blocks calls (per group: GroupManager.num_hit_blocks).
        self.num_queried_tokens = 0
        self.num_hit_tokens = 0
        # Why blocks were not reused (pagedserve.engine.kv_cache.miss_causes): the contents published
        # lately, and the content hashes of requests with extra keys (others' are their block hashes).
        self.misses = MissTracker(2 * num_blocks)
        self.content_hashes: dict[str, list[BlockHash]] = {}

    @property
    def req_to_blocks(self) -> dict[str, list[KVCacheBlock]]:
        """Each request's blocks of every group, the null block left out."""
        out: dict[str, list[KVCacheBlock]] = {}
        for manager in self.groups:
            for req_id, blocks in manager.req_to_blocks.items():
                out.setdefault(req_id, []).extend(b for b in blocks if b is not self.null_block)
        return out

    def empty_blocks(self) -> KVCacheBlocks:
        return KVCacheBlocks(tuple([] for _ in self.groups))

    # -- prefix cache ----------------------------------------------------------------------
    def update_block_hashes(self, request: Request) -> None:
        if self.enable_caching:
            hash_request_blocks(
                self.hash_fn,
                request.all_token_ids,
                self.block_size,
                request.block_hashes,
                request.extra_keys,
            )

    def get_computed_blocks(self, request: Request) -> tuple[KVCacheBlocks, int]:
        """Longest cached prefix of the request, in full blocks, as (blocks, num_tokens): a hit
        of L blocks needs every group's blocks for it (a sliding group's: those its window sees
        from position L * block_size).

        At least one token is always left to compute: the model must run on the last prompt
        token to produce logits, so a fully cached prompt reuses all but its last block.
        """
        if not self.enable_caching:
            return self.empty_blocks(), 0
        self.update_block_hashes(request)
        hashes, tokens = request.block_hashes, request.all_token_ids
        length = (request.num_tokens - 1) // self.block_size
        while True:  # a shorter hit in one group may leave another's window uncached: repeat
            before = length
            for manager in self._hit_order:
                length = manager.longest_hit(hashes, tokens, length)
            if length == before:
                break
        blocks = KVCacheBlocks(tuple(m.hit_blocks(hashes, tokens, length) for m in self.groups))
        self.num_queried_tokens += request.num_tokens
        self.num_hit_tokens += length * self.block_size
        return blocks, length * self.block_size

    def prefix_miss(self, request: Request, num_hit_blocks: int) -> PrefixMiss | None:
        """Why the request's full prompt blocks past its `num_hit_blocks` hits were not reused
        (call before its own blocks are published); None when every one was."""
        max_hit_blocks = (request.num_tokens - 1) // self.block_size
        if num_hit_blocks >= max_hit_blocks:
            return None
        num_tokens = (max_hit_blocks - num_hit_blocks) * self.block_size
        if not self.enable_caching:
            return PrefixMiss(MissCause.GROUP_NOT_CACHED, num_tokens)
        if len(self.groups) > 1:  # the full group held more: another group's window blocks were gone
            full = self._hit_order[0].longest_hit(request.block_hashes, request.all_token_ids, max_hit_blocks)
            if full > num_hit_blocks:
                return PrefixMiss(MissCause.GROUP_NOT_CACHED, num_tokens)
        cause = self.misses.classify(self._content_hashes(request)[num_hit_blocks], request.extra_keys)
        return PrefixMiss(cause, num_tokens)

    def _content_hashes(self, request: Request) -> list[BlockHash]:
        """The request's full blocks hashed without its extra keys (its block hashes if it has none)."""
        if request.extra_keys is None:
            return request.block_hashes
        hashes = self.content_hashes.setdefault(request.request_id, [])
        return hash_request_blocks(self.hash_fn, request.all_token_ids, self.block_size, hashes)

    # -- allocation ------------------------------------------------------------------------
    def allocate_slots(
        self,
        request: Request,
        num_new_tokens: int,
        new_computed_blocks: KVCacheBlocks | None = None,
    ) -> KVCacheBlocks | None:
        """Make room for `num_new_tokens` more tokens after the computed ones, in every group.

        `new_computed_blocks` are prefix-cache hits (first scheduling only); they are appended
        before any new block, and the caller has already counted them in
        `request.num_computed_tokens`. Sliding groups first return the blocks their window has
        left. Returns the newly allocated blocks, or None (and allocates nothing) when the pool
        cannot provide them.
        """
        if num_new_tokens < 1:
            raise ValueError(f"num_new_tokens must be >= 1, got {num_new_tokens}")
        req_id = request.request_id
        hits = (new_computed_blocks or self.empty_blocks()).groups
        num_computed_tokens = request.num_computed_tokens
        num_tokens = num_computed_tokens + num_new_tokens
        self.remove_skipped_blocks(request)
        needed = sum(m.num_blocks_to_allocate(req_id, num_tokens, h) for m, h in zip(self.groups, hits))
        if needed > self.pool.get_num_free_blocks():
            return None
        new = KVCacheBlocks(tuple(m.allocate(req_id, num_tokens, h) for m, h in zip(self.groups, hits)))
        self._cache_full_blocks(request, num_tokens)
        return new

    def remove_skipped_blocks(self, request: Request) -> None:
        """Sliding groups return the blocks the request's next query can no longer see."""
        for manager in self.groups:
            manager.remove_skipped_blocks(request.request_id, request.num_computed_tokens)

    def _cache_full_blocks(self, request: Request, num_tokens: int) -> None:
        """Publish blocks that are full once the scheduled tokens are computed.

        Safe before the forward pass: within every layer, the attention backend writes all new
        K/V before any query reads the cache, so a same-step hit sees complete data.
        """
        if not self.enable_caching:
            return
        self.update_block_hashes(request)
        req_id = request.request_id
        start = self.groups[0].num_cached_blocks.get(req_id, 0)
        for manager in self.groups:
            manager.cache_full_blocks(req_id, request.block_hashes, request.all_token_ids, num_tokens)
        end = self.groups[0].num_cached_blocks.get(req_id, 0)
        if end > start:  # what was published, by content: the miss causes' record
            content = self._content_hashes(request)
            for i in range(start, end):
                self.misses.record(content[i], request.extra_keys)

    def rewind_cached_blocks(self, request: Request, num_valid_tokens: int, num_tokens: int) -> None:
        """Withdraw the request's published blocks past its first `num_valid_tokens` tokens from
        the prefix cache (their KV was not written as planned: an external load fell short), then
        publish again those that are full once `num_tokens` are computed."""
        for manager in self.groups:
            manager.uncache_from(request.request_id, num_valid_tokens // self.block_size)
        self._cache_full_blocks(request, num_tokens)

    def free(self, request: Request) -> None:
        """Release all blocks of the request, tail first (so its tail is evicted first)."""
        for manager in self.groups:
            manager.free(request.request_id)
        self.content_hashes.pop(request.request_id, None)

    def get_block_ids(self, request_id: str) -> list[int]:
        """Group 0's block ids (a full-attention group whenever the model has one)."""
        return self.groups[0].block_ids(request_id)

    def get_group_block_ids(self, request_id: str) -> tuple[list[int], ...]:
        return tuple(m.block_ids(request_id) for m in self.groups)

    @property
    def usage(self) -> float:
        return self.pool.get_usage()

    @property
    def prefix_cache_hit_rate(self) -> float:
        return self.num_hit_tokens / self.num_queried_tokens if self.num_queried_tokens else 0.0
