"""What names a chunk of KV in LMCache's tiers: the chunk hash (the prefix cache's block hash)
and the model fingerprint beside it in every key, so two models, dtypes or KV dtypes never share
chunks in one folder or Redis server."""

from __future__ import annotations

import hashlib
from pathlib import Path

import torch

from pagedserve.engine.kv_cache.hashing import BlockHash, hash_block, root_hash, sha256

# Bump when the chunk layout or key scheme changes: old disk files then simply miss.
# v2: chunk hashes are the prefix cache's block hashes (the first chunk chains from its root).
LAYOUT_VERSION = "v2"


def chunk_hash(obj: tuple) -> BlockHash:
    """LMCache's chunk-hash function, replaced by the prefix cache's `hash_block` with SHA-256.

    LMCache calls it with (parent, token ids, extra keys) and chains chunks through a 64-bit int:
    the first 8 bytes of the previous chunk's hash, or 0 before the first chunk, which chains
    from the prefix cache's seeded root instead. SHA-256 (LMCache falls back to Python's salted
    64-bit `hash` without vLLM) keeps keys stable across processes and a colliding prompt
    impractical to craft. The model, dtype and cache salt are in the key beside this hash.
    """
    prefix, tokens, extra = obj
    parent = root_hash(sha256) if prefix == 0 else BlockHash(int(prefix).to_bytes(8, "big", signed=prefix < 0))
    return hash_block(sha256, parent, tokens, tuple(extra) or None)


def model_fingerprint(model_dir: str | Path, dtype: torch.dtype, kv_cache_dtype: str = "auto") -> str:
    """Identifies the weights (config.json + size and samples of each weights file), dtype and
    KV cache dtype: part of every key, so two models (or one model's bf16 and fp8 KV) never
    share chunks in one disk folder."""
    model_dir = Path(model_dir)
    h = hashlib.sha256(LAYOUT_VERSION.encode() + str(dtype).encode())
    if kv_cache_dtype != "auto":
        h.update(f"kv:{kv_cache_dtype}".encode())
    h.update((model_dir / "config.json").read_bytes())
    for path in sorted(model_dir.glob("*.safetensors")):
        size = path.stat().st_size
        h.update(f"{path.name}:{size}".encode())
        with open(path, "rb") as f:
            for offset in (0, size // 2, max(0, size - (1 << 20))):
                f.seek(offset)
                h.update(f.read(1 << 20))
    return f"pagedserve-{model_dir.name}-{h.hexdigest()[:16]}"
