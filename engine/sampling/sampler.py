"""The sampler: processed logits -> one token per row, plus logprobs of the raw distribution.

Order (vLLM V1): raw logprobs, min_tokens masking, logit bias, penalties, then greedy rows take the argmax
and random rows go through temperature, min-p, top-k, top-p and an exponential-race draw.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from pagedserve.engine.sampling.logits_processors import apply_logit_bias, apply_min_tokens, apply_penalties
from pagedserve.engine.sampling.metadata import SamplingMetadata


@dataclass(slots=True)
class LogprobsTensors:
    token_ids: torch.Tensor  # [N, k+1] int64: the sampled token, then the top-k tokens
    logprobs: torch.Tensor  # [N, k+1] float32, log_softmax of the raw logits
    sampled_ranks: torch.Tensor  # [N] int64, rank of the sampled token (1 = most likely)


@dataclass(slots=True)
class SamplerOutput:
    sampled_token_ids: torch.Tensor  # [N] int64
    logprobs: LogprobsTensors | None  # None when no row asked for logprobs


class Sampler:
    """Stateless; per-row state (generators, seen tokens) comes in the metadata."""

    def __call__(self, logits: torch.Tensor, meta: SamplingMetadata) -> SamplerOutput:
        """Sample one token per row of `logits` [N, V]; `logits` is not modified.

        Logits in a lower precision are widened to float32 first, except for an all-greedy batch
        with nothing to process: the argmax of the raw logits is the same and the copy is skipped.
        """
        if logits.dim() != 2 or logits.shape[0] != meta.num_rows:
            raise ValueError(f"logits {tuple(logits.shape)} do not match {meta.num_rows} rows")
        if not logits.is_floating_point():
            raise ValueError(f"logits must be floating point, got {logits.dtype}")
        if (
            meta.all_greedy
            and meta.max_num_logprobs is None
            and not meta.min_tokens_suppress
            and meta.logit_bias is None
            and meta.no_penalties
        ):
            return SamplerOutput(sampled_token_ids=logits.max(dim=-1).indices, logprobs=None)
        logits = logits.float()
        num_logprobs = meta.max_num_logprobs
        raw_logprobs = None if num_logprobs is None else torch.log_softmax(logits, dim=-1)
        logits = apply_min_tokens(logits, meta.min_tokens_suppress)
        logits = apply_logit_bias(logits, meta.logit_bias)
        if (penalties := meta.penalties()) is not None:
            logits = apply_penalties(logits, *penalties)
        sampled = self.sample(logits, meta)
        logprobs = None
        if raw_logprobs is not None and num_logprobs is not None:
            logprobs = gather_logprobs(raw_logprobs, num_logprobs, sampled)
        return SamplerOutput(sampled_token_ids=sampled, logprobs=logprobs)

    def sample(self, logits: torch.Tensor, meta: SamplingMetadata) -> torch.Tensor:
        """Greedy rows: argmax of the processed logits; random rows: filtered draw."""
        # max(-1).indices == argmax (first maximum) and is ~2.5x faster on CPU (torch 2.13).
        greedy = None if meta.all_random else logits.max(dim=-1).indices
        if greedy is not None and meta.all_greedy:
            return greedy
        drawn = random_sample(processed_probs(logits, meta), meta.generators)
        if greedy is None or meta.greedy_mask is None:  # all random (a mixed batch has the mask)
            return drawn
        return torch.where(meta.greedy_mask, greedy, drawn)


def processed_probs(logits: torch.Tensor, meta: SamplingMetadata) -> torch.Tensor:
    """The distribution random rows draw from: temperature, min-p, top-k and top-p applied to
    float32 logits (greedy rows of a mixed batch get a harmless temperature of 1)."""
    if meta.temperature is None:
        raise ValueError("processed_probs: every row is greedy")
    logits = logits / meta.temperature.unsqueeze(1)
    if meta.min_p is not None:
        logits = apply_min_p(logits, meta.min_p)
    logits = apply_top_k_top_p(logits, meta.top_k, meta.top_p)
    return logits.softmax(dim=-1)


def apply_min_p(logits: torch.Tensor, min_p: torch.Tensor) -> torch.Tensor:
    """Mask tokens whose probability is below min_p times the row's top probability."""
    probs = logits.softmax(dim=-1)
    threshold = probs.amax(dim=-1, keepdim=True) * min_p.unsqueeze(1)
    return logits.masked_fill(probs < threshold, float("-inf"))


def apply_top_k_top_p(logits: torch.Tensor, top_k: torch.Tensor | None, top_p: torch.Tensor | None) -> torch.Tensor:
    """Keep each row's k best tokens (ties with the k-th kept), then its smallest nucleus of
    probability >= p (the most likely token always survives)."""
    if top_p is None:
        if top_k is None:
            return logits
        # Top-k alone needs no full sort.
        kth = logits.topk(int(top_k.max()), dim=-1).values.gather(1, (top_k - 1).unsqueeze(1))
        return logits.masked_fill(logits < kth, float("-inf"))
    ascending, order = logits.sort(dim=-1)
    if top_k is not None:
        kth = ascending.gather(1, (logits.shape[1] - top_k).unsqueeze(1))
        ascending = ascending.masked_fill(ascending < kth, float("-inf"))
    cumulative = ascending.softmax(dim=-1).cumsum(dim=-1)
    drop = cumulative <= (1 - top_p).unsqueeze(1)
    drop[:, -1] = False
    ascending = ascending.masked_fill(drop, float("-inf"))
    return torch.empty_like(logits).scatter_(1, order, ascending)


def random_sample(probs: torch.Tensor, generators: dict[int, torch.Generator]) -> torch.Tensor:
    """Draw one token per row via argmax(probs / q), q ~ Exp(1).

    A row with its own generator draws its q from it alone, so a seeded row's tokens do not
    depend on the rest of the batch; the other rows share one batch-wide draw.
    """
    q = torch.empty_like(probs)
    if len(generators) != probs.shape[0]:
        q.exponential_()
    for row, generator in generators.items():
        q[row].exponential_(generator=generator)
    return probs.div_(q).argmax(dim=-1)


def gather_logprobs(logprobs: torch.Tensor, k: int, sampled: torch.Tensor) -> LogprobsTensors:
    """The sampled token's logprob and rank, then the top-k of each row."""
    top_values, top_ids = logprobs.topk(k, dim=-1)
    sampled = sampled.unsqueeze(1)
    sampled_logprobs = logprobs.gather(1, sampled)
    ranks = (logprobs >= sampled_logprobs).sum(dim=-1)
    return LogprobsTensors(
        token_ids=torch.cat((sampled, top_ids), dim=1),
        logprobs=torch.cat((sampled_logprobs, top_values), dim=1),
        sampled_ranks=ranks,
    )
