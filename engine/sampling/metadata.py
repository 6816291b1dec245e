"""Per-step sampling tensors: one row per sequence that samples this step.

Everything optional is None when no row of the step uses it, so the sampler can skip that work
(a batch of plain greedy rows builds no tensor at all).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from pagedserve.engine.sampling.params import SamplingParams, SamplingType


@dataclass(slots=True)
class SamplingMetadata:
    num_rows: int
    vocab_size: int
    all_greedy: bool
    all_random: bool
    # [N] bool, True for greedy rows; only in a mixed batch (all_greedy / all_random say the rest).
    greedy_mask: torch.Tensor | None
    # [N] float32; None when all rows are greedy. Greedy rows hold 1.0 (their draw is discarded).
    temperature: torch.Tensor | None
    # [N] int64 in [1, vocab_size]; rows without top-k (and greedy rows) hold vocab_size.
    top_k: torch.Tensor | None
    # [N] float32; rows without top-p hold 1.0.
    top_p: torch.Tensor | None
    # [N] float32; rows without min-p hold 0.0.
    min_p: torch.Tensor | None
    # Row index -> that row's generator, random rows only. Other random rows share one draw.
    generators: dict[int, torch.Generator]
    # Penalties: all five are None together (no row has a penalty), else [N] float32 and
    # [N, L] int64 token ids padded with vocab_size (rows without penalties are all padding).
    presence_penalties: torch.Tensor | None
    frequency_penalties: torch.Tensor | None
    repetition_penalties: torch.Tensor | None
    prompt_token_ids: torch.Tensor | None
    output_token_ids: torch.Tensor | None
    # Row index -> token ids to mask this step (min_tokens not yet reached); None if no row.
    min_tokens_suppress: dict[int, list[int]] | None
    # Row index -> {token id: bias} (logit_bias); None if no row has one.
    logit_bias: dict[int, dict[int, float]] | None
    # Largest `logprobs` asked by any row (0 = sampled token only); None when no row asked.
    max_num_logprobs: int | None

    def __post_init__(self) -> None:
        if self.num_rows < 1:
            raise ValueError(f"num_rows must be >= 1, got {self.num_rows}")
        if self.all_greedy and self.all_random:
            raise ValueError("a batch cannot be all greedy and all random")
        if (self.greedy_mask is None) != (self.all_greedy or self.all_random):
            raise ValueError("greedy_mask is set exactly when the batch is mixed")
        if (self.temperature is None) != self.all_greedy:
            raise ValueError("temperature is None exactly when all rows are greedy")

    @property
    def no_penalties(self) -> bool:
        return self.presence_penalties is None

    def penalties(
        self,
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor] | None:
        """(prompt ids, output ids, presence, frequency, repetition) as `apply_penalties` takes
        them, or None when no row has a penalty."""
        prompt, output = self.prompt_token_ids, self.output_token_ids
        presence, frequency, repetition = self.presence_penalties, self.frequency_penalties, self.repetition_penalties
        if prompt is None or output is None or presence is None or frequency is None or repetition is None:
            return None
        return prompt, output, presence, frequency, repetition

    @classmethod
    def build(
        cls,
        params: Sequence[SamplingParams],
        prompt_token_ids: Sequence[Sequence[int]],
        output_token_ids: Sequence[Sequence[int]],
        generators: Sequence[torch.Generator | None],
        eos_token_ids: set[int] | frozenset[int],
        vocab_size: int,
        device: torch.device | str,
    ) -> SamplingMetadata:
        """Build the step's metadata; all lists are per row, in row order."""
        n = len(params)
        if not len(prompt_token_ids) == len(output_token_ids) == len(generators) == n:
            raise ValueError("params, prompt/output token ids and generators differ in length")
        greedy = [p.sampling_type is SamplingType.GREEDY for p in params]
        all_greedy = all(greedy)
        all_random = not any(greedy)

        greedy_mask = temperature = top_k = top_p = min_p = None
        row_generators: dict[int, torch.Generator] = {}
        if not all_greedy:
            if not all_random:
                greedy_mask = torch.tensor(greedy, dtype=torch.bool, device=device)
            # Greedy rows get neutral values so that batch-wide ops leave them finite.
            rand = [(p, not g) for p, g in zip(params, greedy)]
            temperature = _f32([p.temperature if r else 1.0 for p, r in rand], device)
            if any(r and p.top_k > 0 for p, r in rand):
                k = [min(p.top_k, vocab_size) if r and p.top_k > 0 else vocab_size for p, r in rand]
                top_k = torch.tensor(k, dtype=torch.int64, device=device)
            if any(r and p.top_p < 1.0 for p, r in rand):
                top_p = _f32([p.top_p if r else 1.0 for p, r in rand], device)
            if any(r and p.min_p > 0.0 for p, r in rand):
                min_p = _f32([p.min_p if r else 0.0 for p, r in rand], device)
            row_generators = {i: gen for i, gen in enumerate(generators) if gen is not None and not greedy[i]}

        presence = frequency = repetition = prompt_ids = output_ids = None
        penalized = [p.has_penalties for p in params]
        if any(penalized):
            presence = _f32([p.presence_penalty for p in params], device)
            frequency = _f32([p.frequency_penalty for p in params], device)
            repetition = _f32([p.repetition_penalty for p in params], device)
            prompt_ids = _pad([t if k else () for t, k in zip(prompt_token_ids, penalized)], vocab_size, device)
            output_ids = _pad([t if k else () for t, k in zip(output_token_ids, penalized)], vocab_size, device)

        suppress: dict[int, list[int]] = {}
        if any(p.min_tokens for p in params):
            for i, (p, out) in enumerate(zip(params, output_token_ids)):
                if len(out) < p.min_tokens:
                    # vLLM: min_tokens holds back the stop ids and EOS (unless EOS is ignored).
                    held = set(p.stop_token_ids)
                    if not p.ignore_eos:
                        held |= eos_token_ids
                    if ids := sorted(t for t in held if 0 <= t < vocab_size):
                        suppress[i] = ids

        logit_bias = {i: p.logit_bias for i, p in enumerate(params) if p.logit_bias} or None
        asked = [p.logprobs for p in params if p.logprobs is not None]
        return cls(
            num_rows=n,
            vocab_size=vocab_size,
            all_greedy=all_greedy,
            all_random=all_random,
            greedy_mask=greedy_mask,
            temperature=temperature,
            top_k=top_k,
            top_p=top_p,
            min_p=min_p,
            generators=row_generators,
            presence_penalties=presence,
            frequency_penalties=frequency,
            repetition_penalties=repetition,
            prompt_token_ids=prompt_ids,
            output_token_ids=output_ids,
            min_tokens_suppress=suppress or None,
            logit_bias=logit_bias,
            max_num_logprobs=max(asked) if asked else None,
        )


def _f32(values: list[float], device: torch.device | str) -> torch.Tensor:
    return torch.tensor(values, dtype=torch.float32, device=device)


def _pad(rows: list[Sequence[int]], pad: int, device: torch.device | str) -> torch.Tensor:
    """[N, longest] int64, short rows filled with `pad` (an id past the vocabulary)."""
    width = max(len(r) for r in rows)
    return torch.tensor([[*r, *([pad] * (width - len(r)))] for r in rows], dtype=torch.int64, device=device).reshape(
        len(rows), width
    )
