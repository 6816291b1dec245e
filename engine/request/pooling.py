"""Pooling requests: a prompt's embedding instead of generated tokens (vLLM's pooling design).

A pooling request travels the one request path of every request (pagedserve.engine.request.inputs -> the output
processor -> the engine core -> the scheduler -> the model runner) with `PoolingParams` beside
its SamplingParams. It is scheduled like any prompt (chunked prefill, prefix caching,
preemption); at the step that computes its last prompt token the runner pools the final hidden
state (after the model's last norm) instead of sampling, and the request finishes with that
vector and no output token.

Pooling is LAST-token: the final hidden state of the prompt's last token. A causal model's last
position is the only one that has seen the whole prompt, and it is always computed (a prefix
cache hit never covers the last token), so the vector is the same whether or not the prefix
came from the cache. The vector is L2-normalised unless `normalize` is false.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import msgspec

if TYPE_CHECKING:
    import torch


class PoolingParams(msgspec.Struct, forbid_unknown_fields=True):
    """How to pool one request's final hidden states (last token; see the module docstring)."""

    normalize: bool = True  # L2-normalise the pooled vector


def pool_last_token(hidden: torch.Tensor, params: list[PoolingParams]) -> list[list[float]]:
    """Rows of `hidden` ([R, hidden_size], one last-token row per request) -> one vector per
    request, in float32, each L2-normalised when its params ask for it."""
    import torch  # here, where the tensors are: PoolingParams travels through the torch-free front end

    pooled = hidden.float()
    norms = pooled.norm(dim=-1, keepdim=True).clamp_min(1e-12)
    scale = torch.tensor([[p.normalize] for p in params], dtype=torch.bool, device=pooled.device)
    return torch.where(scale, pooled / norms, pooled).tolist()
