"""What the engine hands back per request, vLLM-shaped: the offline API returns these, and the
server shapes them into replies.

The protocol is typed: a finished completion has a `FinishReason`; `stop_reason` is only ever
the stop token id or stop string that ended it; an engine that ended a request early because of
an error (a grammar that failed to compile or timed out, a prompt the worker refused) says so in
`error`, with finish reason ABORT. Unknown values are None, never 0 or -1.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass, field


class FinishReason(enum.StrEnum):
    """Why a completion ended (equal to its string value, which the replies carry)."""

    STOP = "stop"  # EOS, a stop token, a stop string or a complete grammar
    LENGTH = "length"  # max_tokens or max_model_len
    ABORT = "abort"  # aborted by the caller, or ended by an engine error (see `error`)


@dataclass(slots=True)
class TokenLogprob:
    logprob: float
    rank: int  # 1 = the most likely token
    decoded_token: str


@dataclass(slots=True)
class CompletionOutput:
    index: int
    text: str
    token_ids: list[int]
    finish_reason: FinishReason | None = None
    stop_reason: int | str | None = None  # the stop token id or stop string, if one ended it
    logprobs: list[dict[int, TokenLogprob]] | None = None
    error: str | None = None  # why the engine ended it early (finish_reason ABORT)
    embedding: list[float] | None = None  # a pooling request's vector (pagedserve.engine.request.pooling)

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None


@dataclass(slots=True)
class RequestMetrics:
    """When a request went through its phases (time.monotonic(), one clock host-wide) and how
    long each took, in seconds. The server's workers measure these; offline outputs have none."""

    arrival_time: float
    first_scheduled_time: float
    first_token_time: float
    finished_time: float
    itl_s: list[float] = field(default_factory=list)  # gaps between successive outputs

    @property
    def queued_s(self) -> float:
        return max(0.0, self.first_scheduled_time - self.arrival_time)

    @property
    def prefill_s(self) -> float:
        return max(0.0, self.first_token_time - self.first_scheduled_time)

    @property
    def decode_s(self) -> float:
        return max(0.0, self.finished_time - self.first_token_time)

    @property
    def ttft_s(self) -> float:
        return max(0.0, self.first_token_time - self.arrival_time)


class DisaggPath(enum.StrEnum):
    """How a request was served by a version whose workers have prefill and decode roles."""

    DISAGGREGATED = "disaggregated"  # prefilled on a prefill worker, decoded on a decode worker
    LOCAL = "local"  # not worth a hand-off (short prompt, an adapter, pooling): one worker did it all
    FALLBACK = "fallback"  # the hand-off failed or had no worker: one worker prefilled it itself


@dataclass(slots=True)
class DisaggTimings:
    """The time to first token of a disaggregated request, split (seconds): waiting for a worker
    (`queue_s`), computing the prompt on the prefill worker (`prefill_s`), moving its KV through
    the connector (`transfer_s`: the prefill worker's stores and write-through, the gap between the
    workers, the decode worker's loads) and the decode worker's first step (`first_decode_s`).
    `reason` says why a request fell back or stayed local (None: disaggregated)."""

    path: DisaggPath
    queue_s: float = 0.0
    prefill_s: float = 0.0
    transfer_s: float = 0.0
    first_decode_s: float = 0.0
    transfer_bytes: int = 0
    reason: str | None = None
    prefill_worker: str | None = None
    decode_worker: str | None = None


@dataclass(slots=True)
class RequestOutput:
    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput]
    finished: bool = False
    num_cached_tokens: int = 0  # prompt tokens served from the prefix cache
    num_external_cached_tokens: int = 0  # prompt tokens restored from the KV offload tiers
    # (cause, tokens): why full prompt blocks were not reused from the prefix cache
    # (pagedserve.engine.kv_cache.miss_causes.MissCause values); None when every one was
    prefix_miss: tuple[str, int] | None = None
    metrics: RequestMetrics | None = None  # set on the finished output of a worker's request
    kv_transfer_s: float = 0.0  # time in the KV offload connector (loads, stores, write-through)
    kv_transfer_bytes: int = 0  # bytes moved through the KV offload connector
    # Set by the front end on a request served by a prefill and a decode worker
    # (pagedserve.server.workers.disagg): its path and TTFT phases.
    disagg: DisaggTimings | None = None

    @property
    def refusal(self) -> str | None:
        """The engine's error for a request it ended before generating anything (a grammar that
        failed to compile or timed out, a prompt the worker refused), else None."""
        for completion in self.outputs:
            if completion.error is not None and not completion.token_ids:
                return completion.error
        return None
