"""Paged attention as one opaque torch custom op, for a torch.compile'd model.

`torch.compile` cannot trace an attention backend: it branches in Python on the step's
`AttentionMetadata` (lists of lengths, plans cached by identity). So a compiled forward calls
`pagedserve::paged_attention` instead, a `torch.library.custom_op` that the graph keeps as one
opaque call (the compiled graph is split at it: glue and matmuls around it are compiled, the
attention itself runs eagerly in the backend, exactly as without compile).

The step's backend and metadata travel into the op as an `AttentionStep`, a *reference* opaque
object (torch._library.opaque_object): a graph input that compiled code passes through without
looking inside, so a new step never recompiles and no module-level "current batch" is needed.

The compiled forward pads the step's tokens to a bucket size (pagedserve.engine.model.compile): rows past
`meta.num_tokens` are padding; the op neither writes their keys/values nor attends for them
(their output rows are zeros).
"""

from __future__ import annotations

import functools

import torch
from torch._opaque_base import OpaqueBase

from pagedserve.engine.attention.backend import AttentionBackend
from pagedserve.engine.attention.metadata import AttentionMetadata

OP_NAME = "pagedserve::paged_attention"


class AttentionStep(OpaqueBase):
    """One step's attention backend and metadata, handed through a compiled graph unopened."""

    __slots__ = ("backend", "meta")

    def __init__(self, backend: AttentionBackend, meta: AttentionMetadata) -> None:
        self.backend = backend
        self.meta = meta

    def __reduce__(self):
        # Inductor's on-disk cache keys pickle the graph's inputs: a step's contents (a new
        # batch every step, a backend holding a loaded extension) must not be part of the key.
        return AttentionStep, (None, None)


def _paged_attention(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    kv_cache: torch.Tensor,
    step: AttentionStep,
    scale: float,
) -> torch.Tensor:
    n = step.meta.num_tokens
    if n == query.shape[0]:
        return step.backend.forward(query, key, value, kv_cache, step.meta, scale)
    out = torch.zeros_like(query)
    out[:n] = step.backend.forward(query[:n], key[:n], value[:n], kv_cache, step.meta, scale)
    return out


def _fake(query, key, value, kv_cache, step, scale):
    return torch.empty_like(query)


@functools.cache
def paged_attention_op():
    """The registered custom op (registered on first use, once per process):
    `op(query, key, value, kv_cache, step, scale) -> [T, num_heads, head_dim]`, writing the
    step's keys/values into `kv_cache` (declared mutated)."""
    from torch._library.opaque_object import register_opaque_type

    register_opaque_type(AttentionStep, typ="reference")
    op = torch.library.custom_op(OP_NAME, mutates_args=("kv_cache",))(_paged_attention)
    op.register_fake(_fake)
    return op
