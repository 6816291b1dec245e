"""A snapshot of one engine's scheduler and KV pool, for routing and metrics."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(slots=True)
class SchedulerStats:
    num_running: int = 0
    num_waiting: int = 0
    num_kv_blocks: int = 0
    num_free_blocks: int = 0  # includes cached blocks no request holds (evictable)
    prefix_cache_queries: int = 0  # cumulative, in prompt tokens looked up
    prefix_cache_hits: int = 0  # cumulative, in prompt tokens found
    num_preemptions: int = 0  # cumulative
    num_threads: int | None = None  # torch intra-op threads the engine steps with (None: not reported yet)
    spec_draft_tokens: int = 0  # cumulative: draft tokens verified (speculative decoding)
    spec_accepted_tokens: int = 0  # cumulative: of those, kept
    # method auto (pagedserve.engine.spec_decode.adaptive): cumulative (request, step) pairs given drafts
    # and given none; the decayed per-token acceptance rate; a draft token's cost ratio c.
    spec_requests_drafted: int = 0
    spec_requests_skipped: int = 0
    spec_acceptance_rate: float | None = None
    spec_cost_ratio: float | None = None
    # method suffix / auto: the global suffix trie's tokens and memory (upper bound, bytes).
    spec_suffix_global_tokens: int = 0
    spec_suffix_global_bytes: int = 0
    # KV offload counters (pagedserve.engine.kv_offload.stats.KVOffloadStats.as_dict()); None when off.
    kv_offload: dict | None = None

    @property
    def prefix_cache_hit_rate(self) -> float:
        return self.prefix_cache_hits / self.prefix_cache_queries if self.prefix_cache_queries else 0.0
