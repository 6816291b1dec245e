"""Content hashes of full KV blocks, chained from a seeded root.

A block's hash covers its parent block's hash, its token ids and extra keys (LoRA adapter id,
per-request cache salt), so equal hashes mean equal prefixes: a block can be shared by any
request whose prefix up to and including that block is identical. The one definition for the
prefix cache and the KV offload tier (whose chunks are runs of blocks: see
`pagedserve.engine.kv_offload.keys.chunk_hash`).
"""

from __future__ import annotations

import enum
import hashlib
from array import array
from collections.abc import Callable, Sequence
from typing import NewType


class PrefixCacheHash(enum.Enum):
    """The hash function of the prefix cache's block hashes (EngineConfig.prefix_cache_hash)."""

    SHA256 = "sha256"
    # Python's built-in hash over a tuple: fast, not collision-resistant across tenants.
    BUILTIN = "builtin"


BlockHash = NewType("BlockHash", bytes)
HashFn = Callable[[bytes], bytes]

# Seeded root: the "parent" of every first block. Fixed so hashes are stable across processes
# (the KV offload tier relies on that).
ROOT_SEED = b"pagedserve-prefix-cache-v1"


def sha256(data: bytes) -> bytes:
    return hashlib.sha256(data).digest()


def _builtin(data: bytes) -> bytes:
    # Python's hash of bytes is salted per process (PYTHONHASHSEED) and only 64 bits wide: fast,
    # not stable across processes, not collision-resistant. The block pool verifies token ids on
    # every hit, so a collision costs a miss, never wrong KV.
    return hash(data).to_bytes(8, "little", signed=True)


def get_hash_fn(kind: PrefixCacheHash | str) -> HashFn:
    """The hash function of a `PrefixCacheHash` (or its value, e.g. "sha256")."""
    return {"sha256": sha256, "builtin": _builtin}[PrefixCacheHash(kind).value]


def root_hash(hash_fn: HashFn) -> BlockHash:
    return BlockHash(hash_fn(ROOT_SEED))


def hash_block(
    hash_fn: HashFn,
    parent: BlockHash,
    token_ids: Sequence[int],
    extra_keys: tuple[object, ...] | None = None,
) -> BlockHash:
    """Hash one full block: parent hash + token ids (+ extra keys)."""
    payload = parent + array("q", token_ids).tobytes()
    if extra_keys:
        payload += repr(extra_keys).encode()
    return BlockHash(hash_fn(payload))


def hash_request_blocks(
    hash_fn: HashFn,
    token_ids: Sequence[int],
    block_size: int,
    existing: list[BlockHash],
    extra_keys: tuple[object, ...] | None = None,
) -> list[BlockHash]:
    """Extend `existing` (hashes of the first full blocks) with the hashes of newly full blocks.

    Extra keys go into the first block only; chaining carries them into every later hash.
    Returns `existing`, extended in place.
    """
    num_full = len(token_ids) // block_size
    parent = existing[-1] if existing else root_hash(hash_fn)
    for i in range(len(existing), num_full):
        block_tokens = token_ids[i * block_size : (i + 1) * block_size]
        parent = hash_block(hash_fn, parent, block_tokens, extra_keys if i == 0 else None)
        existing.append(parent)
    return existing


def group_key(block_hash: BlockHash, group: int) -> BlockHash:
    """The prefix-cache key of a block of KV cache group `group` (pagedserve.engine.kv_cache.groups):
    the hash itself for group 0, tagged with the group otherwise (each group has its own pages)."""
    return block_hash if group == 0 else BlockHash(block_hash + b"/g" + group.to_bytes(2, "little"))
