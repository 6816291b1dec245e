"""`speculative` settings: the mapping given to `LLM(speculative=...)` or in model-config.yaml
(`handler: speculative:`), with vLLM's names. Absent means off."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

KEYS = ("method", "num_speculative_tokens", "prompt_lookup_max", "prompt_lookup_min")


@dataclass(slots=True, frozen=True)
class SpeculativeConfig:
    """n-gram prompt lookup: the last `prompt_lookup_max`..`prompt_lookup_min` tokens are looked
    up earlier in the request's tokens, and the `num_speculative_tokens` tokens that followed
    there are proposed."""

    num_speculative_tokens: int = 4
    prompt_lookup_max: int = 4
    prompt_lookup_min: int = 2
    method: str = "ngram"

    def __post_init__(self) -> None:
        if self.method != "ngram":
            raise ValueError(f"speculative.method={self.method!r}: only 'ngram' (prompt lookup) is supported")
        for key in ("num_speculative_tokens", "prompt_lookup_max", "prompt_lookup_min"):
            value = getattr(self, key)
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ValueError(f"speculative.{key}={value!r}: must be a positive integer")
        if self.prompt_lookup_min > self.prompt_lookup_max:
            raise ValueError(f"speculative.prompt_lookup_min={self.prompt_lookup_min} exceeds "
                             f"prompt_lookup_max={self.prompt_lookup_max}")

    @classmethod
    def from_options(cls, options: Any) -> SpeculativeConfig:
        if isinstance(options, SpeculativeConfig):
            return options
        if not isinstance(options, dict):
            raise ValueError(f"speculative must be a mapping with keys {', '.join(KEYS)}; "  # noqa: TRY004
                             f"got {type(options).__name__}")
        unknown = set(options) - set(KEYS)
        if unknown:
            raise ValueError(f"speculative: unknown key(s) {sorted(unknown)}; known: {', '.join(KEYS)}")
        return cls(**options)
