"""KV cache blocks and the doubly linked free queue."""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass

from pagedserve.engine.kv_cache.hashing import BlockHash


@dataclass(slots=True, eq=False)
class KVCacheBlock:
    """One block of the paged KV cache.

    A block with ref_cnt == 0 sits in the free queue. It may still carry a hash (lazy
    invalidation): then it is a cached block that a later request can rescue, until the pool
    hands its memory to someone else.
    """

    block_id: int
    ref_cnt: int = 0
    block_hash: BlockHash | None = None
    # Token ids the block holds once cached: a hit is verified against them.
    token_ids: tuple[int, ...] | None = None
    prev_free: KVCacheBlock | None = None
    next_free: KVCacheBlock | None = None

    def reset_hash(self) -> None:
        self.block_hash = None
        self.token_ids = None

    def __repr__(self) -> str:
        return f"KVCacheBlock(id={self.block_id}, ref={self.ref_cnt}, hashed={self.block_hash is not None})"


class FreeBlockQueue:
    """Doubly linked list of free blocks with O(1) popleft, append and removal from the middle.

    The head is the next block to hand out (eviction order: least recently freed first).
    Sentinel head and tail nodes keep the link updates branch-free.
    """

    def __init__(self, blocks: Iterable[KVCacheBlock]) -> None:
        self._head = KVCacheBlock(-1)
        self._tail = KVCacheBlock(-1)
        self._head.next_free = self._tail
        self._tail.prev_free = self._head
        self.num_free_blocks = 0
        for block in blocks:
            self.append(block)

    # The two sentinels are always linked: every block between them has both neighbours.
    def popleft(self) -> KVCacheBlock:
        block = self._head.next_free
        if block is self._tail or block is None:
            raise ValueError("no free blocks")
        self.remove(block)
        return block

    def remove(self, block: KVCacheBlock) -> None:
        if block.prev_free is None or block.next_free is None:
            raise ValueError(f"{block} is not in the free queue")
        block.prev_free.next_free = block.next_free
        block.next_free.prev_free = block.prev_free
        block.prev_free = block.next_free = None
        self.num_free_blocks -= 1

    def append(self, block: KVCacheBlock) -> None:
        if block.prev_free is not None or block.next_free is not None:
            raise ValueError(f"{block} is already in the free queue")
        last = self._tail.prev_free
        assert last is not None
        last.next_free = block
        block.prev_free = last
        block.next_free = self._tail
        self._tail.prev_free = block
        self.num_free_blocks += 1

    def block_ids(self) -> list[int]:
        """Free block ids from head (next evicted) to tail. For tests and debugging."""
        ids = []
        node = self._head.next_free
        while node is not self._tail and node is not None:
            ids.append(node.block_id)
            node = node.next_free
        return ids
