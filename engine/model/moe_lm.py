"""The causal LM of the mixture-of-experts families (Qwen2-MoE, Qwen3-MoE, Mixtral, OLMoE): the
shared decoder whose MLPs are sparse blocks (pagedserve.engine.model.layers.moe), except the layers the
spec's `moe.dense_layers` keeps dense. Each family file parses its config into the spec's
`moe` and, where its checkpoint names differ from the block's, renames them (`checkpoint_name`).
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from typing import Any

import torch
from torch import nn

from pagedserve.engine.model.causal_lm import CausalLM
from pagedserve.engine.model.layers.mlp import GatedMLP
from pagedserve.engine.model.layers.moe import SparseMoeBlock
from pagedserve.engine.model.spec import ModelSpec
from pagedserve.kernels.cpu_fused_ops import CpuFusedOps


def moe_mlp(spec: ModelSpec, layer: int, dtype: torch.dtype, ops: CpuFusedOps | None) -> nn.Module:
    """Layer `layer`'s MLP: a sparse block, or the dense MLP where the spec keeps one."""
    if spec.moe is None or layer in spec.moe.dense_layers:
        return GatedMLP(spec, dtype, ops)
    return SparseMoeBlock(spec.hidden_size, spec.moe, dtype, ops)


def num_experts(cfg: Mapping[str, Any]) -> int:
    """The expert count, spelled `num_experts` (Qwen, OLMoE checkpoints) or `num_local_experts`
    (Mixtral, and transformers 5's own Qwen3-MoE config)."""
    value = cfg.get("num_experts", cfg.get("num_local_experts"))
    if value is None:
        raise ValueError(f"config.json of {cfg.get('architectures')} names no num_experts")
    return int(value)


def qwen_dense_layers(cfg: Mapping[str, Any]) -> tuple[int, ...]:
    """Qwen2/3-MoE: layers in `mlp_only_layers`, and those off the `decoder_sparse_step` grid,
    keep a dense MLP (as transformers builds them)."""
    only = set(cfg.get("mlp_only_layers") or ())
    step = int(cfg.get("decoder_sparse_step") or 1)
    return tuple(
        i for i in range(int(cfg["num_hidden_layers"])) if i in only or num_experts(cfg) <= 0 or (i + 1) % step
    )


class MoECausalLM(CausalLM):
    """A CausalLM with `moe_mlp`; checkpoint names go through `checkpoint_name` before loading."""

    make_mlp = staticmethod(moe_mlp)

    @staticmethod
    def checkpoint_name(name: str) -> str:
        """The block's name for a checkpoint tensor (the same, unless the family renames)."""
        return name

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        super().load_weights((self.checkpoint_name(name), tensor) for name, tensor in weights)
