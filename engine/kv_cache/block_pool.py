"""The block pool: every KV block, the free queue and the hash -> block map of the prefix cache."""

from __future__ import annotations

from collections.abc import Sequence

from pagedserve.engine.kv_cache.block import FreeBlockQueue, KVCacheBlock
from pagedserve.engine.kv_cache.hashing import BlockHash


class BlockPool:
    """Owns all blocks. Invariants:

    - a block is in the free queue iff its ref_cnt is 0;
    - `cached[h] is b` iff `b.block_hash == h` (one block per hash; a second block computed
      with the same content stays uncached and is simply freed);
    - a cached block loses its hash only when popped from the free queue for new use (lazy
      invalidation), so freed blocks can be rescued by a later request with the same prefix.
    """

    def __init__(self, num_blocks: int, enable_caching: bool = True) -> None:
        if num_blocks < 1:
            raise ValueError(f"num_blocks must be >= 1, got {num_blocks}")
        self.num_blocks = num_blocks
        self.enable_caching = enable_caching
        self.blocks = [KVCacheBlock(i) for i in range(num_blocks)]
        self.free_queue = FreeBlockQueue(self.blocks)
        self.cached: dict[BlockHash, KVCacheBlock] = {}
        self.num_evictions = 0

    # -- queries ---------------------------------------------------------------------------
    def get_num_free_blocks(self) -> int:
        return self.free_queue.num_free_blocks

    def get_usage(self) -> float:
        return 1.0 - self.get_num_free_blocks() / self.num_blocks

    def get_cached_block(self, block_hash: BlockHash, token_ids: Sequence[int]) -> KVCacheBlock | None:
        """The cached block with this hash, if its tokens match (guards against collisions)."""
        block = self.cached.get(block_hash)
        if block is None or block.token_ids != tuple(token_ids):
            return None
        return block

    # -- allocation ------------------------------------------------------------------------
    def get_new_blocks(self, n: int) -> list[KVCacheBlock]:
        """Pop n blocks from the head of the free queue (evicting their cached content)."""
        if n > self.get_num_free_blocks():
            raise ValueError(f"cannot allocate {n} blocks: {self.get_num_free_blocks()} free")
        out = []
        for _ in range(n):
            block = self.free_queue.popleft()
            self._evict(block)
            block.ref_cnt = 1
            out.append(block)
        return out

    def touch(self, blocks: Sequence[KVCacheBlock]) -> None:
        """Take a reference on prefix-cache hits, rescuing free ones from the queue."""
        for block in blocks:
            if block.ref_cnt == 0:
                self.free_queue.remove(block)
            block.ref_cnt += 1

    def free_blocks(self, ordered_blocks: Sequence[KVCacheBlock]) -> None:
        """Drop one reference each; blocks reaching 0 join the queue tail in the given order.

        Callers pass a request's blocks in reverse, so its tail is evicted before its head.
        """
        for block in ordered_blocks:
            if block.ref_cnt <= 0:
                raise ValueError(f"double free of {block}")
            block.ref_cnt -= 1
            if block.ref_cnt == 0:
                self.free_queue.append(block)

    def cache_full_block(self, block: KVCacheBlock, block_hash: BlockHash, token_ids: Sequence[int]) -> None:
        """Publish a full block under its hash (no-op if caching is off or the hash is taken)."""
        if not self.enable_caching or block.block_hash is not None or block_hash in self.cached:
            return
        block.block_hash = block_hash
        block.token_ids = tuple(token_ids)
        self.cached[block_hash] = block

    def uncache_block(self, block: KVCacheBlock) -> None:
        """Withdraw a block from the prefix cache while it stays in use (its content is invalid)."""
        if block.block_hash is not None and self.cached.get(block.block_hash) is block:
            del self.cached[block.block_hash]
        block.reset_hash()

    def _evict(self, block: KVCacheBlock) -> None:
        if block.block_hash is None:
            return
        if self.cached.get(block.block_hash) is block:
            del self.cached[block.block_hash]
        block.reset_hash()
        self.num_evictions += 1

    def reset_prefix_cache(self) -> bool:
        """Forget every cached hash. Refused (False) while any block is in use."""
        if self.get_num_free_blocks() != self.num_blocks:
            return False
        for block in self.blocks:
            block.reset_hash()
        self.cached.clear()
        return True
