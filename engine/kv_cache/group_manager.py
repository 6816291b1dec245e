"""One KV cache group's per-request block lists (vLLM's single-type managers): full attention
keeps every block; a sliding window of w tokens keeps only the blocks its next query can see.

A list holds one entry per logical block (block i covers positions [i * bs, (i + 1) * bs)). A
sliding group replaces the blocks it no longer needs by the pool's null block (id -1, never
allocated, never freed), so positions keep their index. Blocks published in the prefix cache carry
the group in their key (`group_key`): a hit in one group never hands out another group's page.
"""

from __future__ import annotations

from collections.abc import Sequence

from pagedserve.engine.kv_cache.block import KVCacheBlock
from pagedserve.engine.kv_cache.block_pool import BlockPool
from pagedserve.engine.kv_cache.hashing import BlockHash, group_key


def cdiv(a: int, b: int) -> int:
    return -(-a // b)


class GroupManager:
    """Full attention: a request's blocks are every block of its context."""

    def __init__(self, group: int, window: int | None, pool: BlockPool, null_block: KVCacheBlock, block_size: int):
        self.group = group
        self.window = window
        self.pool = pool
        self.null_block = null_block
        self.block_size = block_size
        self.req_to_blocks: dict[str, list[KVCacheBlock]] = {}
        # How many leading blocks of each request are already published in the prefix cache.
        self.num_cached_blocks: dict[str, int] = {}
        # Prefix-cache hits: blocks of this group reused from the cache (null entries not counted).
        self.num_hit_blocks = 0

    # -- prefix cache ----------------------------------------------------------------------
    def _cached(self, i: int, hashes: Sequence[BlockHash], tokens: Sequence[int]) -> KVCacheBlock | None:
        bs = self.block_size
        return self.pool.get_cached_block(group_key(hashes[i], self.group), tokens[i * bs : (i + 1) * bs])

    def first_needed_block(self, num_computed: int) -> int:
        """The first block the query at position `num_computed` reads (0: all of them)."""
        return 0

    def longest_hit(self, hashes: Sequence[BlockHash], tokens: Sequence[int], max_blocks: int) -> int:
        """The largest L <= max_blocks such that the blocks a query at position L * bs needs are
        all cached."""
        for i in range(max_blocks):
            if self._cached(i, hashes, tokens) is None:
                return i
        return max_blocks

    def hit_blocks(self, hashes: Sequence[BlockHash], tokens: Sequence[int], length: int) -> list[KVCacheBlock]:
        """The first `length` blocks of a hit (`longest_hit` found them cached); the null block
        where the group no longer needs one."""
        first = self.first_needed_block(length * self.block_size)
        blocks = [self.null_block] * first
        for i in range(first, length):
            block = self._cached(i, hashes, tokens)
            assert block is not None, "hit_blocks past longest_hit"
            blocks.append(block)
        self.num_hit_blocks += length - first
        return blocks

    # -- allocation ------------------------------------------------------------------------
    def num_blocks_to_allocate(self, req_id: str, num_tokens: int, hits: Sequence[KVCacheBlock]) -> int:
        """New blocks (from the free queue) to cover `num_tokens` tokens, and hits sitting in the
        free queue, which are no longer free once taken: what this group takes from the pool."""
        have = len(self.req_to_blocks.get(req_id, ())) + len(hits)
        evictable = sum(1 for b in hits if b.ref_cnt == 0 and b is not self.null_block)
        return max(0, cdiv(num_tokens, self.block_size) - have) + evictable

    def allocate(self, req_id: str, num_tokens: int, hits: Sequence[KVCacheBlock]) -> list[KVCacheBlock]:
        blocks = self.req_to_blocks.setdefault(req_id, [])
        if hits:
            self.pool.touch([b for b in hits if b is not self.null_block])
            blocks.extend(hits)
            self.num_cached_blocks[req_id] = len(blocks)  # hits are published already
        new = self.pool.get_new_blocks(max(0, cdiv(num_tokens, self.block_size) - len(blocks)))
        blocks.extend(new)
        return new

    def cache_full_blocks(
        self, req_id: str, hashes: Sequence[BlockHash], tokens: Sequence[int], num_tokens: int
    ) -> None:
        """Publish the request's blocks that are full once `num_tokens` tokens are computed."""
        blocks = self.req_to_blocks[req_id]
        start = self.num_cached_blocks.get(req_id, 0)
        end = min(num_tokens // self.block_size, len(hashes))
        bs = self.block_size
        for i in range(start, end):
            if blocks[i] is not self.null_block:
                self.pool.cache_full_block(blocks[i], group_key(hashes[i], self.group), tokens[i * bs : (i + 1) * bs])
        self.num_cached_blocks[req_id] = max(start, end)

    def uncache_from(self, req_id: str, first: int) -> None:
        """Withdraw the request's published blocks from index `first` on (their KV is invalid)."""
        blocks = self.req_to_blocks.get(req_id, [])
        for block in blocks[first : self.num_cached_blocks.get(req_id, 0)]:
            if block is not self.null_block:
                self.pool.uncache_block(block)
        self.num_cached_blocks[req_id] = min(self.num_cached_blocks.get(req_id, 0), first)

    def remove_skipped_blocks(self, req_id: str, num_computed: int) -> None:
        """Return the blocks the request's next query (at position `num_computed`) cannot see."""

    def free(self, req_id: str) -> None:
        """Release all blocks of the request, tail first (so its tail is evicted first)."""
        blocks = self.req_to_blocks.pop(req_id, [])
        self.num_cached_blocks.pop(req_id, None)
        self.pool.free_blocks([b for b in reversed(blocks) if b is not self.null_block])

    def block_ids(self, req_id: str) -> list[int]:
        return [b.block_id for b in self.req_to_blocks.get(req_id, [])]

    def num_held_blocks(self, req_id: str) -> int:
        """Blocks of the pool the request holds in this group (null entries not counted)."""
        return sum(1 for b in self.req_to_blocks.get(req_id, []) if b is not self.null_block)


class SlidingWindowManager(GroupManager):
    """A window of w tokens: the query at position p reads positions (p - w, p]."""

    def __init__(self, group: int, window: int, pool: BlockPool, null_block: KVCacheBlock, block_size: int):
        super().__init__(group, window, pool, null_block, block_size)
        self.sliding_window = window

    def first_needed_block(self, num_computed: int) -> int:
        return max(0, num_computed - self.sliding_window + 1) // self.block_size

    def longest_hit(self, hashes: Sequence[BlockHash], tokens: Sequence[int], max_blocks: int) -> int:
        """Scanned from the right: the longest L whose window blocks [first_needed(L), L) are
        all cached. A block i missing rules out every L in (i, end): their windows hold it."""
        end = max_blocks
        i = end - 1
        while True:
            first = self.first_needed_block(end * self.block_size)
            while i >= first and self._cached(i, hashes, tokens) is not None:
                i -= 1
            if i < first:
                return end
            end, i = i, i - 1

    def remove_skipped_blocks(self, req_id: str, num_computed: int) -> None:
        blocks = self.req_to_blocks.get(req_id)
        if not blocks:
            return
        first = min(self.first_needed_block(num_computed), len(blocks))
        skipped = []
        for i in range(first - 1, -1, -1):
            if blocks[i] is self.null_block:
                break  # everything before was removed already
            skipped.append(blocks[i])
            blocks[i] = self.null_block
        # Oldest first into the free queue: evicted before the newer window blocks.
        self.pool.free_blocks(skipped[::-1])


def make_group_manager(
    group: int, window: int | None, pool: BlockPool, null_block: KVCacheBlock, block_size: int
) -> GroupManager:
    if window is None:
        return GroupManager(group, None, pool, null_block, block_size)
    return SlidingWindowManager(group, window, pool, null_block, block_size)
