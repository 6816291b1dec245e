"""Counters of one engine's KV offload, per model (one engine = one model worker)."""

from __future__ import annotations

from dataclasses import asdict, dataclass, field


@dataclass(slots=True)
class KVOffloadStats:
    """Cumulative since the engine started. Token counts are prompt tokens.

    `hit_tokens_*`: tokens restored into the engine's blocks, by the tier they came from (the
    engine's own block pool is counted by the KV cache manager). `faults` counts every failure
    that was absorbed (the affected tokens were recomputed); `fault_kinds` splits it by kind.
    """

    lookups: int = 0
    hit_tokens_cpu: int = 0
    hit_tokens_disk: int = 0
    hit_tokens_remote: int = 0  # from the shared Redis tier
    stored_tokens: int = 0
    stored_chunks: int = 0
    loaded_bytes: int = 0
    stored_bytes: int = 0
    load_time_s: float = 0.0
    store_time_s: float = 0.0
    disk_pruned_files: int = 0
    faults: int = 0
    fault_kinds: dict[str, int] = field(default_factory=dict)

    @property
    def hit_tokens(self) -> int:
        return self.hit_tokens_cpu + self.hit_tokens_disk + self.hit_tokens_remote

    def count_fault(self, kind: str) -> None:
        self.faults += 1
        self.fault_kinds[kind] = self.fault_kinds.get(kind, 0) + 1

    def as_dict(self) -> dict:
        out = asdict(self)
        out["hit_tokens"] = self.hit_tokens
        out["fault_kinds"] = dict(self.fault_kinds)
        return out
