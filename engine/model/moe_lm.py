"""The causal LM of the mixture-of-experts families (Qwen2-MoE, Qwen3-MoE, Mixtral, OLMoE): the
shared decoder whose MLPs are sparse blocks (pagedserve.engine.model.layers.moe), except the layers the
spec's `moe.dense_layers` keeps dense. Each family file parses its config into the spec's
`moe`; the families' classes are below, and rename checkpoint names where they differ from the
block's (`checkpoint_name`).
"""

from __future__ import annotations

import re
from collections.abc import Iterable

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


class MoECausalLM(CausalLM):
    """A CausalLM with `moe_mlp`; checkpoint names go through `checkpoint_name` before loading."""

    make_mlp = staticmethod(moe_mlp)

    @staticmethod
    def checkpoint_name(name: str) -> str:
        """The block's name for a checkpoint tensor (the same, unless the family renames)."""
        return name

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        super().load_weights((self.checkpoint_name(name), tensor) for name, tensor in weights)


_EXPERT = re.compile(r"\.block_sparse_moe\.experts\.(\d+)\.(w1|w2|w3)\.")
_PROJ = {"w1": "gate_proj", "w3": "up_proj", "w2": "down_proj"}


class OlmoeForCausalLM(MoECausalLM):
    """Checkpoint names are the block's own (`mlp.gate`, `mlp.experts.{e}`)."""


class Qwen2MoeForCausalLM(MoECausalLM):
    """Checkpoint names are the block's own (`mlp.gate`, `mlp.experts.{e}`, `mlp.shared_expert`)."""


class Qwen3MoeForCausalLM(MoECausalLM):
    """Checkpoint names are the block's own (`mlp.gate`, `mlp.experts.{e}`)."""


class MixtralForCausalLM(MoECausalLM):
    @staticmethod
    def checkpoint_name(name: str) -> str:
        """`...block_sparse_moe.experts.3.w1.weight` -> `...mlp.experts.3.gate_proj.weight`;
        `...block_sparse_moe.gate.weight` -> `...mlp.gate.weight`."""
        name = _EXPERT.sub(lambda m: f".mlp.experts.{m.group(1)}.{_PROJ[m.group(2)]}.", name)
        return name.replace(".block_sparse_moe.gate.", ".mlp.gate.")
