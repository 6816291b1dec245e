"""What crosses the socket between a front end and an engine-core process (msgpack via msgspec).

Requests and outputs reuse the engine's own types (SamplingParams, EngineCoreOutput,
SchedulerStats): msgspec encodes them as they are. A worker decodes SamplingParams with the very
declaration the front end validated the request body against (types, bounds, cross-field rules),
so a value one side accepts the other cannot refuse.
"""

from __future__ import annotations

import msgspec

from pagedserve.engine.lora.request import LoRARequest
from pagedserve.engine.request.pooling import PoolingParams
from pagedserve.engine.sampling.params import SamplingParams, TokenId
from pagedserve.engine.scheduler.output import EngineCoreOutput
from pagedserve.engine.scheduler.stats import SchedulerStats


class EngineCoreRequest(msgspec.Struct, tag="add"):
    request_id: str
    prompt_token_ids: list[TokenId]
    sampling_params: SamplingParams
    priority: int = 0
    arrival_time: float | None = None  # time.monotonic() in the front end; None = on arrival in the engine
    cache_salt: str | None = None
    pooling_params: PoolingParams | None = None  # a pooling request (pagedserve.engine.request.pooling)
    lora: LoRARequest | None = None  # run under this LoRA adapter (None: the base model)
    kv_produce: bool = False  # disaggregated prefill: the prompt's KV written through before finishing


class AbortRequests(msgspec.Struct, tag="abort"):
    request_ids: list[str]


class Shutdown(msgspec.Struct, tag="shutdown"):
    pass


class SetThreads(msgspec.Struct, tag="threads"):
    """Use this many torch threads from the next step on (the front end rebalances the cores
    when workers come and go)."""

    num_threads: int


class Sleep(msgspec.Struct, tag="sleep"):
    """Free the KV pool and the weights (the process, its imports and compiled kernels stay);
    answered with a SleepState. Refused while requests are unfinished."""


class Wake(msgspec.Struct, tag="wake"):
    """Load the weights again (from the model directory) and a fresh KV pool; answered with
    a SleepState."""


EngineCoreInput = EngineCoreRequest | AbortRequests | Shutdown | SetThreads | Sleep | Wake


class EngineInfo(msgspec.Struct, tag="ready"):
    """Sent once by a worker whose engine is built and ready for requests."""

    pid: int
    max_model_len: int
    vocab_size: int
    num_kv_blocks: int
    block_size: int


class EngineCoreOutputs(msgspec.Struct, tag="outputs"):
    """The news of one step (or an idle heartbeat with only stats)."""

    outputs: list[EngineCoreOutput]
    stats: SchedulerStats
    timestamp: float = 0.0  # time.monotonic() when the step finished


class EngineFailure(msgspec.Struct, tag="failure"):
    """The worker could not start, or its engine raised: it exits right after sending this."""

    message: str


class SleepState(msgspec.Struct, tag="sleep_state"):
    """The answer to Sleep or Wake: the state the worker is in now, its resident memory after
    the change, how long the change took, and why it was refused (None: done)."""

    sleeping: bool
    rss_bytes: int
    seconds: float
    error: str | None = None


EngineCoreEvent = EngineInfo | EngineCoreOutputs | EngineFailure | SleepState


def make_input_decoder() -> msgspec.msgpack.Decoder:
    return msgspec.msgpack.Decoder(EngineCoreInput)


def make_event_decoder() -> msgspec.msgpack.Decoder:
    return msgspec.msgpack.Decoder(EngineCoreEvent)
