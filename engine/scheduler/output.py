"""What the scheduler hands to the model runner each step, and what comes back."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import torch

from pagedserve.engine.lora.request import LoRARequest
from pagedserve.engine.request.outputs import FinishReason
from pagedserve.engine.request.pooling import PoolingParams
from pagedserve.engine.sampling.params import SamplingParams


@dataclass(slots=True)
class NewRequestData:
    """A request the runner has not seen (new, or resumed after preemption): sent in full."""

    req_id: str
    token_ids: list[int]  # prompt + any output generated before a preemption
    num_prompt_tokens: int
    sampling_params: SamplingParams
    block_ids: tuple[list[int], ...]  # one block table per KV cache group (-1: a block a sliding group dropped)
    num_computed_tokens: int
    pooling_params: PoolingParams | None = None
    lora: LoRARequest | None = None  # the request's adapter (None: the base model)


@dataclass(slots=True)
class CachedRequestData:
    """A running request the runner already holds: only what changed since the last step."""

    req_id: str
    new_block_ids: tuple[list[int], ...]  # per KV cache group, appended to its table
    num_computed_tokens: int


@dataclass(slots=True)
class SchedulerOutput:
    new_requests: list[NewRequestData]
    cached_requests: list[CachedRequestData]
    num_scheduled_tokens: dict[str, int]
    total_num_scheduled_tokens: int
    # Requests the runner must forget (finished, aborted or preempted since the last step).
    finished_req_ids: set[str] = field(default_factory=set)
    preempted_req_ids: set[str] = field(default_factory=set)
    # Structured output: one allowed-token bitmask row (xgrammar's packed int32 layout) per
    # constrained request that samples this step, and the row of each request id.
    grammar_bitmask: torch.Tensor | None = None
    grammar_rows: dict[str, int] = field(default_factory=dict)
    # Speculative decoding: the draft tokens scheduled after each request's newest token (the
    # request's num_scheduled_tokens counts them); the runner verifies them.
    scheduled_spec_tokens: dict[str, list[int]] = field(default_factory=dict)

    @property
    def is_empty(self) -> bool:
        return self.total_num_scheduled_tokens == 0


@dataclass(slots=True)
class Logprobs:
    """Logprobs of one generated token: the sampled token first, then the top-k."""

    token_ids: list[int]
    logprobs: list[float]
    sampled_rank: int


@dataclass(slots=True)
class ModelRunnerOutput:
    """Sampled tokens of the requests that reached the end of their known tokens this step,
    and the pooled vectors of the pooling requests that reached the end of their prompt."""

    sampled_token_ids: dict[str, list[int]]
    logprobs: dict[str, list[Logprobs]] = field(default_factory=dict)
    pooled: dict[str, list[float]] = field(default_factory=dict)


@dataclass(slots=True)
class EngineCoreOutput:
    """Per-request news after a step: new tokens and, at the end, why it finished.

    `stop_reason` is the stop token id that ended the request, nothing else; an engine error
    (a grammar that failed, a refused request) is `error`, with finish reason ABORT."""

    request_id: str
    new_token_ids: list[int]
    new_logprobs: list[Logprobs] | None = None
    finish_reason: FinishReason | None = None
    stop_reason: int | str | None = None
    error: str | None = None
    num_cached_tokens: int = 0
    num_external_cached_tokens: int = 0  # prompt tokens restored from KV offload (LMCache)
    # (cause, tokens) of its prefix-cache miss (pagedserve.engine.kv_cache.miss_causes); None: no miss
    prefix_miss: tuple[str, int] | None = None
    first_scheduled_time: float | None = None  # time.monotonic() in the engine process (same clock host-wide)
    pooled: list[float] | None = None  # a pooling request's vector (it finishes with it)
    kv_transfer_s: float = 0.0  # so far: time in the KV offload connector (loads, stores, write-through)
    kv_transfer_bytes: int = 0  # so far: bytes it moved through the connector

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None
