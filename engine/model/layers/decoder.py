"""Decoder layers and the decoder stack (embedding, layers, final norm), shared by the families.

A layer takes `h` (the previous layer's output, not yet added to the residual stream) and
`residual` (None on the first layer, where `h` is the embedding) and returns its own
`(output, residual before adding it)`, so that each residual add fuses with the norm after it.

- `DecoderLayer`: pre-norm (Llama, Mistral, Qwen, Phi-3): norm -> attention -> add -> norm -> MLP.
- `SandwichDecoderLayer`: Gemma 2 / 3, which also norm each block's output before its add and
  the MLP's input after it.
A family swaps the MLP (a mixture of experts) by passing `make_mlp`.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import nn

from pagedserve.engine.attention.backend import AttentionBackend
from pagedserve.engine.attention.compiled_op import AttentionStep
from pagedserve.engine.attention.metadata import AttentionMetadata
from pagedserve.engine.lora.punica import LoRALayer
from pagedserve.engine.model.layers.attention import Attention
from pagedserve.engine.model.layers.mlp import GatedMLP
from pagedserve.engine.model.layers.norm import make_norm
from pagedserve.engine.model.spec import ModelSpec
from pagedserve.kernels.cpu_fused_ops import CpuFusedOps

Rope = dict[str, tuple[torch.Tensor, torch.Tensor]]
# (spec, layer index, dtype, fused ops) -> the layer's MLP module (`forward(h, lora)`)
MakeMLP = Callable[[ModelSpec, int, torch.dtype, CpuFusedOps | None], nn.Module]


def dense_mlp(spec: ModelSpec, layer: int, dtype: torch.dtype, ops: CpuFusedOps | None) -> nn.Module:
    del layer
    return GatedMLP(spec, dtype, ops)


class DecoderLayer(nn.Module):
    def __init__(
        self,
        spec: ModelSpec,
        layer: int,
        dtype: torch.dtype,
        backend: AttentionBackend,
        ops: CpuFusedOps | None = None,
        make_mlp: MakeMLP = dense_mlp,
    ) -> None:
        super().__init__()
        self.input_layernorm = make_norm(spec, spec.hidden_size, dtype, ops)
        self.self_attn = Attention(spec, layer, dtype, backend, ops)
        self.post_attention_layernorm = make_norm(spec, spec.hidden_size, dtype, ops)
        self.mlp = make_mlp(spec, layer, dtype, ops)

    def forward(
        self,
        h: torch.Tensor,
        residual: torch.Tensor | None,
        rope: Rope,
        kv_cache: torch.Tensor,
        meta: AttentionMetadata | AttentionStep,
        lora: LoRALayer | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        if residual is None:
            residual, h = h, self.input_layernorm(h)
        else:
            h, residual = self.input_layernorm(h, residual)
        h = self.self_attn(h, rope, kv_cache, meta, lora)
        h, residual = self.post_attention_layernorm(h, residual)
        return self.mlp(h, lora), residual


class SandwichDecoderLayer(DecoderLayer):
    """Gemma 2 / 3: `x + post_attn_norm(attn(input_norm(x)))`, then
    `x + post_ff_norm(mlp(pre_ff_norm(x)))`: the plain layer's parts plus two norms around the
    MLP, and its own forward."""

    def __init__(
        self,
        spec: ModelSpec,
        layer: int,
        dtype: torch.dtype,
        backend: AttentionBackend,
        ops: CpuFusedOps | None = None,
        make_mlp: MakeMLP = dense_mlp,
    ) -> None:
        super().__init__(spec, layer, dtype, backend, ops, make_mlp)
        self.pre_feedforward_layernorm = make_norm(spec, spec.hidden_size, dtype, ops)
        self.post_feedforward_layernorm = make_norm(spec, spec.hidden_size, dtype, ops)

    def forward(
        self,
        h: torch.Tensor,
        residual: torch.Tensor | None,
        rope: Rope,
        kv_cache: torch.Tensor,
        meta: AttentionMetadata | AttentionStep,
        lora: LoRALayer | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        if residual is None:
            residual, h = h, self.input_layernorm(h)
        else:
            h, residual = self.input_layernorm(h, residual)
        h = self.post_attention_layernorm(self.self_attn(h, rope, kv_cache, meta, lora))
        h, residual = self.pre_feedforward_layernorm(h, residual)
        return self.post_feedforward_layernorm(self.mlp(h, lora)), residual


class DecoderModel(nn.Module):
    """`embed_tokens`, `layers`, `norm`: the HF `model.*` names, so checkpoints load by name."""

    def __init__(
        self,
        spec: ModelSpec,
        dtype: torch.dtype,
        backend: AttentionBackend,
        ops: CpuFusedOps | None = None,
        layer_cls: type[nn.Module] = DecoderLayer,
        make_mlp: MakeMLP = dense_mlp,
    ) -> None:
        super().__init__()
        # Given its (empty) weight, nn.Embedding skips its random init: on the meta device that
        # init alone imports torch._dynamo (seconds of every worker's start); load_weights fills it.
        weight = torch.empty(spec.vocab_size, spec.hidden_size, dtype=dtype)
        # nn.Embedding; an Int8Embedding once quantized, a VocabParallelEmbedding on a rank
        self.embed_tokens: nn.Module = nn.Embedding(spec.vocab_size, spec.hidden_size, _weight=weight)
        self.layers = nn.ModuleList(layer_cls(spec, i, dtype, backend, ops, make_mlp) for i in range(spec.num_layers))
        self.norm = make_norm(spec, spec.hidden_size, dtype, ops)
