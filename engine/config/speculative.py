"""`speculative` settings: the mapping given to `LLM(speculative=...)` or in model-config.yaml
(`handler: speculative:`), with vLLM's names. Absent means off. Declared once as a msgspec
Struct; errors name the field ("speculative.method: ...")."""

from __future__ import annotations

import enum
from typing import Annotated, Any

import msgspec
from msgspec import Meta

from pagedserve.engine.config.schema import SchemaError, check_fields, convert

MAX_SPEC_TOKENS = 32


class SpecMethod(enum.Enum):
    NGRAM = "ngram"  # prompt lookup in the request's own tokens
    SUFFIX = "suffix"  # suffix tries over the request and over recent outputs of the model
    DRAFT = "draft"  # a smaller model with the same tokenizer (draft_model)
    AUTO = "auto"  # suffix drafts, each request's length chosen per step by a cost model


PosInt = Annotated[int, Meta(ge=1, le=MAX_SPEC_TOKENS)]
Prob = Annotated[float, Meta(ge=0.0, le=1.0)]


class _SpeculativeFields(msgspec.Struct, frozen=True, kw_only=True, forbid_unknown_fields=True):
    """The declaration: every field's type and bounds (SpeculativeConfig adds the rules between
    fields)."""

    method: SpecMethod = SpecMethod.NGRAM
    num_speculative_tokens: PosInt = 4
    prompt_lookup_max: PosInt = 4
    prompt_lookup_min: PosInt = 2
    suffix_max_depth: Annotated[int, Meta(ge=2, le=256)] = 24
    suffix_global_tokens: Annotated[int, Meta(ge=0, le=1 << 22)] = 16384
    suffix_min_prob: Prob = 0.1
    suffix_spec_factor: Annotated[float, Meta(gt=0.0, le=MAX_SPEC_TOKENS)] = 1.0
    draft_model: Annotated[str, Meta(min_length=1)] | None = None  # method draft: its model directory


class SpeculativeConfig(_SpeculativeFields, frozen=True, forbid_unknown_fields=True):
    """`num_speculative_tokens`: the most drafts per request and step. ngram: the last
    `prompt_lookup_max`..`prompt_lookup_min` tokens are looked up earlier in the request's
    tokens and what followed is proposed. suffix / auto: the longest suffix of the request's
    tokens (up to `suffix_max_depth` - 1 tokens) is matched in the request's own suffix trie and
    in a global one over the outputs of the last finished requests (at most
    `suffix_global_tokens` tokens), and the likeliest continuation is followed while its
    estimated probability stays >= `suffix_min_prob`, for at most `suffix_spec_factor` x the
    match's length tokens. auto: each request's draft length is
    chosen every step (0 included) from its acceptance rate and the measured step cost. draft:
    `draft_model` (a model directory with the served model's tokenizer) proposes greedily."""

    def __post_init__(self) -> None:
        # Python callers may name the method as a string: take the converted one.
        msgspec.structs.force_setattr(self, "method", check_fields(self, _SpeculativeFields).method)
        if (self.method is SpecMethod.DRAFT) != (self.draft_model is not None):
            raise SchemaError("draft_model: is required with method 'draft' and only allowed with it", "draft_model")
        if self.prompt_lookup_min > self.prompt_lookup_max:
            raise SchemaError(
                f"prompt_lookup_min: {self.prompt_lookup_min} exceeds prompt_lookup_max={self.prompt_lookup_max}",
                "prompt_lookup_min",
            )

    @classmethod
    def from_options(cls, options: Any) -> SpeculativeConfig:
        if isinstance(options, SpeculativeConfig):
            return options
        if not isinstance(options, dict):
            raise SchemaError(f"speculative: must be an object, got {type(options).__name__}")
        try:
            return convert(options, cls)
        except SchemaError as exc:
            text = str(exc)
            named = exc.field is not None and text.startswith(exc.field)
            raise SchemaError(
                f"speculative{'.' if named else ': '}{text}", f"speculative.{exc.field}" if exc.field else "speculative"
            ) from None

    def as_dict(self) -> dict:
        return msgspec.to_builtins(self)
