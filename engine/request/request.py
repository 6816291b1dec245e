"""An engine request: prompt, sampling params, generated tokens and scheduling state."""

from __future__ import annotations

import enum
import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from pagedserve.engine.kv_cache.hashing import BlockHash
from pagedserve.engine.kv_cache.miss_causes import PrefixMiss
from pagedserve.engine.lora.request import LoRARequest
from pagedserve.engine.request.outputs import FinishReason
from pagedserve.engine.request.pooling import PoolingParams
from pagedserve.engine.sampling.params import SamplingParams

if TYPE_CHECKING:  # the grammar module works on requests; a request only holds its state
    from pagedserve.engine.structured_output.manager import GrammarState


class RequestStatus(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    PREEMPTED = "preempted"
    FINISHED_STOPPED = "finished_stopped"
    FINISHED_LENGTH = "finished_length"
    FINISHED_ABORTED = "finished_aborted"

    @property
    def is_finished(self) -> bool:
        return self in (
            RequestStatus.FINISHED_STOPPED,
            RequestStatus.FINISHED_LENGTH,
            RequestStatus.FINISHED_ABORTED,
        )

    @property
    def finish_reason(self) -> FinishReason | None:
        return _FINISH_REASONS.get(self)


_FINISH_REASONS = {
    RequestStatus.FINISHED_STOPPED: FinishReason.STOP,
    RequestStatus.FINISHED_LENGTH: FinishReason.LENGTH,
    RequestStatus.FINISHED_ABORTED: FinishReason.ABORT,
}


@dataclass(slots=True, eq=False)
class Request:
    """State the scheduler keeps per request.

    `num_computed_tokens` is the only progress counter: tokens [0, num_computed_tokens) of
    `all_token_ids` have KV in the cache. There is no prefill/decode phase.
    """

    request_id: str
    prompt_token_ids: list[int]
    sampling_params: SamplingParams
    eos_token_ids: frozenset[int] = frozenset()
    arrival_time: float = field(default_factory=time.monotonic)
    priority: int = 0
    cache_salt: str | None = None
    pooling_params: PoolingParams | None = None  # a pooling request: its embedding, no tokens
    lora: LoRARequest | None = None  # the LoRA adapter to run under (None: the base model)
    # The adapter's identity (name and content digest), set by the engine when it accepts the
    # request: an extra key of the block hashes, so KV is never shared across adapters.
    lora_id: str | None = None
    kv_produce: bool = False  # disaggregated prefill: its KV is written through before it finishes
    # Time (s) and bytes this request moved through the KV offload connector (stores, loads).
    kv_transfer_s: float = 0.0
    kv_transfer_bytes: int = 0
    status: RequestStatus = RequestStatus.WAITING
    all_token_ids: list[int] = field(init=False)
    num_computed_tokens: int = 0
    # Set when the request is first scheduled (first_scheduled_time None until then): prompt
    # tokens found in the prefix cache, prompt tokens restored from the KV offload tiers, and
    # time.monotonic().
    num_cached_tokens: int = 0
    num_external_cached_tokens: int = 0
    # Why its full prompt blocks past the hits were not reused (pagedserve.engine.kv_cache.miss_causes);
    # None when all were, or before it is first scheduled.
    prefix_miss: PrefixMiss | None = None
    first_scheduled_time: float | None = None
    num_preemptions: int = 0
    stop_reason: int | str | None = None  # the stop token id or stop string that ended it
    block_hashes: list[BlockHash] = field(default_factory=list)
    # The structured-output grammar (pagedserve.engine.structured_output.manager.GrammarState), if constrained.
    grammar: GrammarState | None = None
    # Speculative decoding: tokens drafted after the newest one, verified at the next step.
    spec_token_ids: list[int] = field(default_factory=list)

    def __post_init__(self) -> None:
        if not self.prompt_token_ids:
            raise ValueError("the prompt must contain at least one token")
        self.all_token_ids = list(self.prompt_token_ids)

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def num_tokens(self) -> int:
        return len(self.all_token_ids)

    @property
    def num_output_tokens(self) -> int:
        return len(self.all_token_ids) - len(self.prompt_token_ids)

    @property
    def output_token_ids(self) -> list[int]:
        return self.all_token_ids[len(self.prompt_token_ids) :]

    @property
    def extra_keys(self) -> tuple[object, ...] | None:
        """Keys mixed into the first block hash: requests differing here never share KV."""
        if self.lora_id is None and self.cache_salt is None:
            return None
        return (self.lora_id, self.cache_salt)

    @property
    def is_finished(self) -> bool:
        return self.status.is_finished

    def append_output_token_ids(self, token_ids: list[int]) -> None:
        self.all_token_ids.extend(token_ids)
