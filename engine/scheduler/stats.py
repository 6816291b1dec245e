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
    # KV offload counters (engine.kv_offload.stats.KVOffloadStats.as_dict()); None when off.
    kv_offload: dict | None = None

    @property
    def prefix_cache_hit_rate(self) -> float:
        return self.prefix_cache_hits / self.prefix_cache_queries if self.prefix_cache_queries else 0.0
