"""Small builders shared by the KV cache and scheduler tests."""

from __future__ import annotations

import itertools

from pagedserve.engine.config.engine import PrefixCacheHash
from pagedserve.engine.kv_cache.hashing import get_hash_fn
from pagedserve.engine.kv_cache.manager import KVCacheManager
from pagedserve.engine.request.request import Request
from pagedserve.engine.sampling.params import SamplingParams

_ids = itertools.count()


def make_request(
    prompt: list[int],
    *,
    request_id: str | None = None,
    max_tokens: int = 16,
    cache_salt: str | None = None,
    priority: int = 0,
    arrival_time: float | None = None,
    eos: frozenset[int] = frozenset(),
    **params,
) -> Request:
    kwargs = {} if arrival_time is None else {"arrival_time": arrival_time}
    return Request(
        request_id=request_id or f"req-{next(_ids)}",
        prompt_token_ids=list(prompt),
        sampling_params=SamplingParams(max_tokens=max_tokens, **params),
        eos_token_ids=eos,
        cache_salt=cache_salt,
        priority=priority,
        **kwargs,
    )


def make_manager(
    num_blocks: int,
    block_size: int = 4,
    hash_kind: PrefixCacheHash = PrefixCacheHash.SHA256,
    enable_caching: bool = True,
) -> KVCacheManager:
    return KVCacheManager(num_blocks, block_size, get_hash_fn(hash_kind), enable_caching)
