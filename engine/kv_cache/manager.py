"""Per-request KV block bookkeeping on top of the block pool: prefix hits, allocation, freeing."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Protocol

from pagedserve.engine.kv_cache.block import KVCacheBlock
from pagedserve.engine.kv_cache.block_pool import BlockPool
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


def cdiv(a: int, b: int) -> int:
    return -(-a // b)


class KVCacheManager:
    """Maps requests to their block lists. Block tables are append-only while a request runs;
    freeing returns every block (in reverse order) at once."""

    def __init__(
        self,
        num_blocks: int,
        block_size: int,
        hash_fn: HashFn,
        enable_caching: bool = True,
    ) -> None:
        self.block_size = block_size
        self.hash_fn = hash_fn
        self.enable_caching = enable_caching
        self.pool = BlockPool(num_blocks, enable_caching)
        self.req_to_blocks: dict[str, list[KVCacheBlock]] = {}
        # How many leading blocks of each request are already published in the prefix cache.
        self.num_cached_blocks: dict[str, int] = {}
        # Prefix-cache statistics over get_computed_blocks calls.
        self.num_queried_tokens = 0
        self.num_hit_tokens = 0
        # Why blocks were not reused (pagedserve.engine.kv_cache.miss_causes): the contents published
        # lately, and the content hashes of requests with extra keys (others' are their block hashes).
        self.misses = MissTracker(2 * num_blocks)
        self.content_hashes: dict[str, list[BlockHash]] = {}

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

    def get_computed_blocks(self, request: Request) -> tuple[list[KVCacheBlock], int]:
        """Longest cached prefix of the request, in full blocks, as (blocks, num_tokens).

        At least one token is always left to compute: the model must run on the last prompt
        token to produce logits, so a fully cached prompt reuses all but its last block.
        """
        if not self.enable_caching:
            return [], 0
        self.update_block_hashes(request)
        max_hit_blocks = (request.num_tokens - 1) // self.block_size
        blocks: list[KVCacheBlock] = []
        bs = self.block_size
        for i, block_hash in enumerate(request.block_hashes[:max_hit_blocks]):
            block = self.pool.get_cached_block(block_hash, request.all_token_ids[i * bs : (i + 1) * bs])
            if block is None:
                break
            blocks.append(block)
        self.num_queried_tokens += request.num_tokens
        self.num_hit_tokens += len(blocks) * bs
        return blocks, len(blocks) * bs

    def prefix_miss(self, request: Request, num_hit_blocks: int) -> PrefixMiss | None:
        """Why the request's full prompt blocks past its `num_hit_blocks` hits were not reused
        (call before its own blocks are published); None when every one was."""
        max_hit_blocks = (request.num_tokens - 1) // self.block_size
        if num_hit_blocks >= max_hit_blocks:
            return None
        num_tokens = (max_hit_blocks - num_hit_blocks) * self.block_size
        if not self.enable_caching:
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
        new_computed_blocks: list[KVCacheBlock] | None = None,
    ) -> list[KVCacheBlock] | None:
        """Make room for `num_new_tokens` more tokens after the computed ones.

        `new_computed_blocks` are prefix-cache hits (first scheduling only); they are appended
        before any new block, and the caller has already counted them in
        `request.num_computed_tokens`. Returns the newly allocated blocks, or None (and changes
        nothing) when the pool cannot provide them.
        """
        if num_new_tokens < 1:
            raise ValueError(f"num_new_tokens must be >= 1, got {num_new_tokens}")
        computed = new_computed_blocks or []
        req_blocks = self.req_to_blocks.setdefault(request.request_id, [])
        num_computed_tokens = request.num_computed_tokens
        num_required = cdiv(num_computed_tokens + num_new_tokens, self.block_size)
        num_new_blocks = num_required - len(req_blocks) - len(computed)
        # Hits sitting in the free queue will be rescued, so they are not available for new use.
        num_evictable_hits = sum(1 for b in computed if b.ref_cnt == 0)
        if num_new_blocks > self.pool.get_num_free_blocks() - num_evictable_hits:
            if not req_blocks:
                del self.req_to_blocks[request.request_id]
            return None
        if computed:
            self.pool.touch(computed)
            req_blocks.extend(computed)
        new_blocks = self.pool.get_new_blocks(max(num_new_blocks, 0))
        req_blocks.extend(new_blocks)
        self._cache_full_blocks(request, num_computed_tokens + num_new_tokens)
        return new_blocks

    def _cache_full_blocks(self, request: Request, num_tokens: int) -> None:
        """Publish blocks that are full once the scheduled tokens are computed.

        Safe before the forward pass: within every layer, the attention backend writes all new
        K/V before any query reads the cache, so a same-step hit sees complete data.
        """
        if not self.enable_caching:
            return
        self.update_block_hashes(request)
        req_id = request.request_id
        blocks = self.req_to_blocks[req_id]
        start = self.num_cached_blocks.get(req_id, 0)
        end = min(num_tokens // self.block_size, len(request.block_hashes))
        bs = self.block_size
        content = self._content_hashes(request) if end > start else []
        for i in range(start, end):
            self.pool.cache_full_block(blocks[i], request.block_hashes[i], request.all_token_ids[i * bs : (i + 1) * bs])
            self.misses.record(content[i], request.extra_keys)
        self.num_cached_blocks[req_id] = max(start, end)

    def rewind_cached_blocks(self, request: Request, num_valid_tokens: int, num_tokens: int) -> None:
        """Withdraw the request's published blocks past its first `num_valid_tokens` tokens from
        the prefix cache (their KV was not written as planned: an external load fell short), then
        publish again those that are full once `num_tokens` are computed."""
        req_id = request.request_id
        blocks = self.req_to_blocks.get(req_id, [])
        first = num_valid_tokens // self.block_size
        for block in blocks[first : self.num_cached_blocks.get(req_id, 0)]:
            self.pool.uncache_block(block)
        self.num_cached_blocks[req_id] = min(self.num_cached_blocks.get(req_id, 0), first)
        self._cache_full_blocks(request, num_tokens)

    def free(self, request: Request) -> None:
        """Release all blocks of the request, tail first (so its tail is evicted first)."""
        blocks = self.req_to_blocks.pop(request.request_id, [])
        self.num_cached_blocks.pop(request.request_id, None)
        self.content_hashes.pop(request.request_id, None)
        self.pool.free_blocks(list(reversed(blocks)))

    def get_block_ids(self, request_id: str) -> list[int]:
        return [b.block_id for b in self.req_to_blocks.get(request_id, [])]

    @property
    def usage(self) -> float:
        return self.pool.get_usage()

    @property
    def prefix_cache_hit_rate(self) -> float:
        return self.num_hit_tokens / self.num_queried_tokens if self.num_queried_tokens else 0.0
