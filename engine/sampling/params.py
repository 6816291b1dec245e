"""Per-request sampling parameters (vLLM's names and meanings), declared once as a msgspec
Struct with a bound on every number.

The same declaration checks a request three times over without being written three times: the
server's front end converts request bodies to it (`pagedserve.engine.config.schema.convert`), the worker decodes it
from the wire (`pagedserve.engine.core.messages.EngineCoreRequest`), and a SamplingParams built in Python
is checked in `__post_init__`. The cross-field rules live in `__post_init__` too.
"""

from __future__ import annotations

import enum
from typing import Annotated

import msgspec
from msgspec import Meta

from pagedserve.engine.config.schema import SchemaError, check_fields
from pagedserve.engine.structured_output.params import StructuredOutputsParams

_GREEDY_EPS = 1e-5

# The bounds (README "Inference API" documents them).
MAX_N = 32  # choices per request, on every route
MAX_TEMPERATURE = 100.0
MAX_TOP_K = 1 << 20  # larger than any vocabulary; -1 and 0 both mean "off"
MIN_REPETITION_PENALTY, MAX_REPETITION_PENALTY = 0.01, 100.0
MAX_TOKENS = 1 << 20  # max_tokens and min_tokens (the model's max_model_len applies as well)
MAX_LOGPROBS = 20
MAX_STOP_STRINGS, MAX_STOP_CHARS = 64, 1024
MAX_STOP_TOKEN_IDS = 64
MAX_TOKEN_ID = (1 << 31) - 1
MAX_LOGIT_BIAS = 300  # token ids per request's logit_bias (OpenAI's limit)
MAX_BIAS = 100.0  # |bias| per token: -100 bans a token, +100 all but forces it
SEED_RANGE = (-(1 << 63), 1 << 64)  # torch's generator seeds: [-2^63, 2^64)

TokenId = Annotated[int, Meta(ge=0, le=MAX_TOKEN_ID)]
_StopString = Annotated[str, Meta(min_length=1, max_length=MAX_STOP_CHARS)]


class SamplingType(enum.Enum):
    GREEDY = "greedy"
    RANDOM = "random"


class _SamplingFields(msgspec.Struct, forbid_unknown_fields=True):
    """The declaration: every field's type and bounds (SamplingParams adds the rules between
    fields). Booleans are strict: "yes" is not true."""

    n: Annotated[int, Meta(ge=1, le=MAX_N)] = 1
    temperature: Annotated[float, Meta(ge=0, le=MAX_TEMPERATURE)] = 1.0  # finite: no NaN, no Infinity
    top_p: Annotated[float, Meta(gt=0, le=1)] = 1.0
    top_k: Annotated[int, Meta(ge=-1, le=MAX_TOP_K)] = 0  # 0 (or -1) = disabled
    min_p: Annotated[float, Meta(ge=0, le=1)] = 0.0
    presence_penalty: Annotated[float, Meta(ge=-2, le=2)] = 0.0
    frequency_penalty: Annotated[float, Meta(ge=-2, le=2)] = 0.0
    repetition_penalty: Annotated[float, Meta(ge=MIN_REPETITION_PENALTY, le=MAX_REPETITION_PENALTY)] = 1.0
    # [-2^63, 2^64), checked in __post_init__ (msgspec bounds stop at int64)
    seed: int | None = None
    max_tokens: Annotated[int, Meta(ge=1, le=MAX_TOKENS)] | None = 16  # None = up to max_model_len
    min_tokens: Annotated[int, Meta(ge=0, le=MAX_TOKENS)] = 0
    ignore_eos: bool = False
    # One string or a list (kept as a list).
    stop: _StopString | Annotated[list[_StopString], Meta(max_length=MAX_STOP_STRINGS)] = []
    stop_token_ids: Annotated[list[TokenId], Meta(max_length=MAX_STOP_TOKEN_IDS)] = []
    include_stop_str_in_output: bool = False
    # Number of top logprobs per generated token (plus the sampled one).
    logprobs: Annotated[int, Meta(ge=0, le=MAX_LOGPROBS)] | None = None
    skip_special_tokens: bool = True
    # Constrain the output to a JSON schema, any JSON, a regex, a choice or a grammar (xgrammar;
    # vLLM's name and fields).
    structured_outputs: StructuredOutputsParams | None = None
    # Token id -> a bias added to its logit before sampling (OpenAI's logit_bias).
    logit_bias: (
        Annotated[dict[TokenId, Annotated[float, Meta(ge=-MAX_BIAS, le=MAX_BIAS)]], Meta(max_length=MAX_LOGIT_BIAS)]
        | None
    ) = None


class SamplingParams(_SamplingFields):
    """How to sample one request; a bad value raises ValueError (pagedserve.engine.config.schema.SchemaError)
    naming the field, e.g. "max_tokens: must be >= 1, got 0"."""

    def __post_init__(self) -> None:
        # Python callers may pass structured_outputs as a mapping: take the converted one.
        self.structured_outputs = check_fields(self, _SamplingFields).structured_outputs
        if isinstance(self.stop, str):
            self.stop = [self.stop]
        if self.top_k == -1:
            self.top_k = 0
        if self.seed is not None and not SEED_RANGE[0] <= self.seed < SEED_RANGE[1]:
            raise SchemaError(f"seed: must be >= -2^63 and < 2^64, got {self.seed}", "seed")
        if self.max_tokens is not None and self.min_tokens > self.max_tokens:
            raise SchemaError(
                f"min_tokens: must be <= max_tokens ({self.max_tokens}), got {self.min_tokens}", "min_tokens"
            )
        if self.structured_outputs is not None and self.min_tokens:
            # A complete grammar allows only the stop token, which min_tokens would forbid.
            raise SchemaError("min_tokens: cannot be combined with structured output", "min_tokens")

    @property
    def sampling_type(self) -> SamplingType:
        return SamplingType.GREEDY if self.temperature < _GREEDY_EPS else SamplingType.RANDOM

    @property
    def has_penalties(self) -> bool:
        return self.presence_penalty != 0 or self.frequency_penalty != 0 or self.repetition_penalty != 1


def child_seed(seed: int | None, index: int) -> int | None:
    """Child i of an n-way request samples with seed+i (wrapped into SEED_RANGE: torch reads a
    seed modulo 2^64, so the wrap changes nothing but keeps the value valid)."""
    if seed is None:
        return None
    low, high = SEED_RANGE
    return (seed + index - low) % (high - low) + low
