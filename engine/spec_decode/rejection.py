"""Verification of drafted tokens: which of them the target model keeps, plus one token of its
own, so that the output follows exactly the distribution of one-token-at-a-time decoding.

A request with k drafts has k + 1 rows of target logits: row i scores the token after draft i-1
(row 0: after the last known token). Greedy: drafts are kept while each equals its row's argmax,
then the argmax of the first row that disagrees (or of the last row) follows, so the tokens are
those plain greedy decoding gives. Random: the n-gram draft is a point mass, so rejection
sampling keeps draft i with probability p_i(draft) and, on rejection, draws from p_i with the
draft removed and renormalized; after k kept drafts a last token is drawn from p_k.
"""

from __future__ import annotations

import torch


def verify_greedy(target_ids: list[int], drafts: list[int]) -> list[int]:
    """`target_ids`: the argmax of each of the k + 1 rows. Returns 1..k+1 tokens."""
    out = []
    for target, draft in zip(target_ids, drafts):
        out.append(target)
        if target != draft:
            return out
    out.append(target_ids[len(drafts)])
    return out


def rejection_sample(probs: torch.Tensor, drafts: list[int], generator: torch.Generator | None) -> list[int]:
    """`probs [k + 1, V]`: the target's sampling distribution (temperature, top-k/p, min-p
    applied) at each row. Returns 1..k+1 tokens."""
    out = []
    uniforms = torch.rand(len(drafts), generator=generator, device=probs.device).tolist()
    for i, draft in enumerate(drafts):
        if uniforms[i] < float(probs[i, draft]):
            out.append(draft)
            continue
        residual = probs[i].clone()
        residual[draft] = 0.0
        out.append(_draw(residual, generator))
        return out
    out.append(_draw(probs[len(drafts)].clone(), generator))
    return out


def _draw(weights: torch.Tensor, generator: torch.Generator | None) -> int:
    """One draw proportional to `weights` (modified in place) with the exponential race the
    sampler uses."""
    q = torch.empty_like(weights).exponential_(generator=generator)
    return int(weights.div_(q).argmax())
