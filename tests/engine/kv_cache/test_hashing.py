"""Chained block hashes: pure, seeded, sensitive to every input."""

from __future__ import annotations

import pytest

from pagedserve.engine.config.engine import PrefixCacheHash
from pagedserve.engine.kv_cache.hashing import get_hash_fn, hash_block, hash_request_blocks, root_hash

KINDS = list(PrefixCacheHash)


@pytest.mark.parametrize("kind", KINDS)
def test_hash_is_pure_and_chained(kind):
    fn = get_hash_fn(kind)
    root = root_hash(fn)
    h1 = hash_block(fn, root, [1, 2, 3, 4])
    assert h1 == hash_block(fn, root, (1, 2, 3, 4))
    assert h1 != hash_block(fn, root, [1, 2, 3, 5])
    h2 = hash_block(fn, h1, [5, 6, 7, 8])
    assert h2 != hash_block(fn, root, [5, 6, 7, 8])  # parent matters
    assert h1 != hash_block(fn, root, [1, 2, 3, 4], ("salt",))  # extra keys matter


@pytest.mark.parametrize("kind", KINDS)
def test_request_hashes_extend_only_full_blocks(kind):
    fn = get_hash_fn(kind)
    hashes: list = []
    hash_request_blocks(fn, list(range(10)), 4, hashes)
    assert len(hashes) == 2
    first = list(hashes)
    hash_request_blocks(fn, list(range(12)), 4, hashes)
    assert hashes[:2] == first and len(hashes) == 3
    salted = hash_request_blocks(fn, list(range(12)), 4, [], ("lora", "tenant-a"))
    assert all(a != b for a, b in zip(salted, hashes))


@pytest.mark.parametrize("kind", KINDS)
def test_no_collisions_over_many_blocks(kind):
    fn = get_hash_fn(kind)
    root = root_hash(fn)
    seen = {hash_block(fn, root, [i, j]) for i in range(200) for j in range(50)}
    assert len(seen) == 200 * 50


def test_sha256_is_stable_across_processes():
    # A fixed value: the disk tier of the KV offload relies on cross-process stability.
    import hashlib
    from array import array

    fn = get_hash_fn(PrefixCacheHash.SHA256)
    expected = hashlib.sha256(
        hashlib.sha256(b"pagedserve-prefix-cache-v1").digest() + array("q", [1, 2, 3]).tobytes()
    ).digest()
    assert hash_block(fn, root_hash(fn), [1, 2, 3]) == expected
