"""What the offline API (and later the server) hands back per request, vLLM-shaped."""

from __future__ import annotations

from dataclasses import dataclass, field


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
    finish_reason: str | None = None  # "stop" | "length" | "abort"
    stop_reason: int | str | None = None  # the stop token id or stop string, if one ended it
    logprobs: list[dict[int, TokenLogprob]] | None = None

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None


@dataclass(slots=True)
class RequestOutput:
    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput]
    finished: bool = False
    num_cached_tokens: int = 0  # prompt tokens served from the prefix cache
    num_external_cached_tokens: int = 0  # prompt tokens restored from the KV offload tiers
    metrics: dict[str, float] = field(default_factory=dict)
