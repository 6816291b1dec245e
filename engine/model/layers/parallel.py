"""The layers that differ on a tensor-parallel rank, as in Megatron-LM and vLLM.

A rank's projections are built at its shard's sizes (pagedserve.engine.model.sharding), so the
column-parallel ones (q/k/v, gate/up: a slice of the output rows) need nothing more. The
row-parallel ones (o_proj, down_proj: a slice of the input columns) each give a partial sum of
the whole output, which an all-reduce completes; the embedding holds a slice of the vocabulary
and looks up only the ids inside it (zeros elsewhere), which an all-reduce completes as well.
The LM head's slice of the logits is gathered to rank 0 by `CausalLM.compute_logits`.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING, Protocol, cast

import torch
import torch.nn.functional as F
from torch import nn

if TYPE_CHECKING:
    from pagedserve.engine.model.layers.decoder import DecoderModel


class RankGroup(Protocol):
    """What a model's shard calls of its tensor-parallel group
    (pagedserve.engine.parallel.group.TensorParallelGroup, which the process side owns)."""

    rank: int
    size: int

    def all_reduce(self, tensor: torch.Tensor) -> torch.Tensor: ...
    def gather_vocab(self, logits: torch.Tensor) -> torch.Tensor | None: ...


class _Reduced(Protocol):
    """A block whose output a tensor-parallel rank completes (attention, MLP, MoE)."""

    reduce: Callable[[torch.Tensor], torch.Tensor] | None


class VocabParallelEmbedding(nn.Module):
    """Rows `[start, start + num_local)` of the embedding table; `forward(ids)` returns the whole
    embedding of every id (the ranks' lookups summed). `weight` keeps nn.Embedding's name, so the
    checkpoint's `model.embed_tokens.weight` slice loads into it, and a tied LM head reads it."""

    def __init__(self, num_local: int, dim: int, dtype: torch.dtype, start: int, group: RankGroup) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.empty(num_local, dim, dtype=dtype))
        self.start, self.num_local, self.group = start, num_local, group

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        local = input_ids - self.start
        outside = (local < 0) | (local >= self.num_local)
        out = F.embedding(local.masked_fill(outside, 0), self.weight)
        out.masked_fill_(outside.unsqueeze(-1), 0)
        return self.group.all_reduce(out)


class SplitRMSNorm(nn.Module):
    """An RMSNorm over a vector split among the ranks (OLMoE's q/k norms span every head; a rank
    holds its heads' part): each rank holds its part of the weight, and the mean of squares is
    the all-reduced sum of the ranks' squares over the whole size. Rounds like
    pagedserve.engine.model.layers.norm.RMSNorm (float32, cast back, then the weight)."""

    def __init__(self, size: int, full: int, eps: float, dtype: torch.dtype, group: RankGroup) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.empty(size, dtype=dtype))
        self.full, self.eps, self.group = full, eps, group

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = x.float()
        squares = self.group.all_reduce(h.pow(2).sum(-1, keepdim=True))
        h = h * torch.rsqrt(squares / self.full + self.eps)
        return self.weight * h.to(x.dtype)


def parallelize(model: DecoderModel, group: RankGroup, vocab_per_rank: int) -> None:
    """Make `model` (built at its rank's sizes, on the meta device, before its weights load)
    rank `group.rank`'s part: a vocabulary-parallel embedding, an all-reduce after every
    row-parallel projection, and q/k norms over whole projections (OLMoE) split."""
    embedding = model.embed_tokens
    assert isinstance(embedding, nn.Embedding)  # tensor parallelism takes no quantized embedding
    model.embed_tokens = VocabParallelEmbedding(
        vocab_per_rank, embedding.embedding_dim, embedding.weight.dtype, group.rank * vocab_per_rank, group
    )
    for layer in model.layers:
        for part in ("self_attn", "mlp"):  # row-parallel projections inside: all-reduce their sums
            cast(_Reduced, layer.get_submodule(part)).reduce = group.all_reduce
        attn = layer.self_attn
        if getattr(
            attn, "qk_norm_full", False
        ):  # each rank holds an equal share of the heads (sharding refuses replicas)
            for name in ("q_norm", "k_norm"):
                norm = getattr(attn, name)
                size = norm.weight.shape[0]
                setattr(attn, name, SplitRMSNorm(size, size * group.size, norm.eps, norm.weight.dtype, group))
