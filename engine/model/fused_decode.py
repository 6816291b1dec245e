"""The fused decode path on CPU: a step whose rows are all decodes runs each decoder layer as
one C++ call (kernels/csrc/decode_layer.h through the native extension's `DecodeStack`), and
consecutive such layers as one call, so a batch-1 step costs a few dozen dispatcher calls
instead of ~2,000.

A layer takes the fused path when it is the pre-norm layer (`DecoderLayer`: Llama, Mistral,
Qwen2/3, Phi-3) or Gemma 2/3's sandwich layer (`SandwichDecoderLayer`), with the family's
RMSNorm (Llama's or Gemma's), q/k norms per head or none, a sliding window or none, soft-capped
scores or not, the gated dense MLP (SiLU or GELU-tanh), on one process (no tensor parallelism),
with the model-dtype KV cache, and projections the extension multiplies: float32/bfloat16
(nn.Linear, or the bf16 CPU layers that keep the plain weight), weight-only int8 (`Int8Linear`:
int8 codes widened in registers, the channel scale after the sum) or int4 (`Int4Linear`: the
native int4 GEMV on torch's packed layout), each rounded as its layer rounds. Every other layer
runs its own module in the same step (`FusedDecode.reasons` says why, per layer): mixtures of
experts, q/k norms over whole projections (OLMoE), W8A8 projections, quantized KV caches,
tensor-parallel shards.
A step takes the fused path when every row is a decode, there are at most `MAX_ROWS` of them,
no row has a LoRA adapter, and the forward is not being traced by torch.compile.

`PAGEDSERVE_FUSED_DECODE=0` turns the path off (the reference path runs instead).
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch
from torch import nn

from pagedserve.engine.attention.metadata import AttentionMetadata
from pagedserve.engine.model.layers.decoder import DecoderLayer, SandwichDecoderLayer
from pagedserve.engine.model.layers.mlp import GatedMLP
from pagedserve.engine.model.quant_linear import Int4Linear, Int8Linear
from pagedserve.engine.model.spec import NormKind
from pagedserve.kernels.cpu_int4_dequant import packed_block_n
from pagedserve.kernels.cpu_native import load_native

if TYPE_CHECKING:
    from pagedserve.engine.model.causal_lm import CausalLM

MAX_ROWS = 16  # decode rows at most: the GEMVs read each weight row once for all rows; more rows take oneDNN's GEMMs
_DTYPES = (torch.float32, torch.bfloat16)


def fused_decode_disabled() -> bool:
    return os.environ.get("PAGEDSERVE_FUSED_DECODE") == "0"


def _plain_weight(proj: nn.Module) -> tuple[torch.Tensor, torch.Tensor | None] | None:
    """(weight [out, in], bias) of a projection whose plain weight is at hand, else None."""
    weight = getattr(proj, "weight", None)
    if not isinstance(weight, torch.Tensor) or weight.dim() != 2:
        return None
    bias = getattr(proj, "bias", None)
    return weight, bias if isinstance(bias, torch.Tensor) else None


# The extension's projection kinds (kernels/csrc/decode_layer_api.h, ps::ProjKind).
_PLAIN, _INT8, _INT4 = 0, 1, 2
ProjArg = tuple[int, torch.Tensor, torch.Tensor | None, torch.Tensor | None, torch.Tensor | None, int, int]


def proj_arg(proj: nn.Module, dtype: torch.dtype) -> ProjArg | str:
    """The extension's form of a projection: (kind, weight, bias, scale, shift, group size,
    block rows), or why the fused layer cannot run it. int8 and int4 run the same kernels as
    their layers' few-row paths (weight-only int8; the native int4 GEMV)."""
    if isinstance(proj, Int8Linear):
        if proj.weight_only_max_rows < MAX_ROWS or not proj.qweight.is_contiguous():
            return "a W8A8 projection (activations quantized per token)"
        return (_INT8, proj.qweight, proj.bias, proj.kernel_scale, None, 0, 0)
    if isinstance(proj, Int4Linear):
        if proj.dequant is None:
            return "an int4 projection without the native GEMV"
        scale, shift = proj.gemv_scale_shift
        return (_INT4, proj.packed, proj.bias, scale, shift, proj.group_size, packed_block_n())
    plain = _plain_weight(proj)
    if plain is None or plain[0].dtype != dtype:
        return f"a {type(proj).__name__} (not a {dtype} weight)"
    weight, bias = plain
    return (_PLAIN, weight.contiguous(), None if bias is None else bias.contiguous(), None, None, 0, 0)


def _projections(layer: Any) -> list[tuple[str, nn.Module]]:
    attn, mlp = layer.self_attn, layer.mlp
    return [
        ("qkv_proj", attn.qkv_proj),
        ("o_proj", attn.o_proj),
        ("gate_up_proj", mlp.gate_up_proj),
        ("down_proj", mlp.down_proj),
    ]


def layer_refusal(layer: nn.Module, dtype: torch.dtype, intermediate: int) -> str | None:
    """Why `layer` cannot take the fused path (None: it can)."""
    if type(layer) not in (DecoderLayer, SandwichDecoderLayer):
        return f"{type(layer).__name__} (neither the pre-norm nor the sandwich layer)"
    attn: Any = layer.self_attn
    mlp: Any = layer.mlp
    if not isinstance(mlp, GatedMLP):
        return "mixture of experts"
    checks = (
        (attn.qk_norm_full, "q/k norms over whole projections"),
        (attn.reduce is not None or mlp.reduce is not None, "tensor-parallel shard"),
        (attn.backend.kv_dtype.quantized, "quantized KV cache"),
    )
    for failed, reason in checks:
        if failed:
            return reason
    for name, proj in _projections(layer):
        arg = proj_arg(proj, dtype)
        if isinstance(arg, str):
            return f"{name} is {arg}"
    gate_up = mlp.gate_up_proj
    if getattr(gate_up, "out_features", None) != 2 * intermediate:
        return "an MLP of another width"
    return None


def _layer_tables(model: CausalLM, layer: Any) -> list[torch.Tensor | None]:
    """Input norm, post-attention norm, pre- and post-feedforward norms (the sandwich layer's),
    q and k norms (per head), RoPE cos, RoPE sin."""
    attn = layer.self_attn
    half = model.spec.head_dim // 2
    cos = getattr(model, f"rope_{attn.rope_table}_cos").reshape(-1, half)
    sin = getattr(model, f"rope_{attn.rope_table}_sin").reshape(-1, half)
    sandwich = isinstance(layer, SandwichDecoderLayer)
    return [
        layer.input_layernorm.weight,
        layer.post_attention_layernorm.weight,
        layer.pre_feedforward_layernorm.weight if sandwich else None,
        layer.post_feedforward_layernorm.weight if sandwich else None,
        None if attn.q_norm is None else attn.q_norm.weight,
        None if attn.k_norm is None else attn.k_norm.weight,
        cos.contiguous(),
        sin.contiguous(),
    ]


def _layer_params(layer: Any) -> tuple[float, int, float]:
    """(score scale, sliding window or 0, soft cap or 0)."""
    attn = layer.self_attn
    return float(attn.scale), int(attn.window or 0), float(attn.softcap or 0.0)


@dataclass(slots=True)
class FusedDecode:
    """The model's fused layers: `stack` holds them in model order, `index[i]` is layer i's place
    in it (None: layer i runs its own module, for `reasons[i]`)."""

    stack: Any  # the extension's DecodeStack
    index: list[int | None]
    reasons: list[str | None]
    weights: frozenset[int]  # ids of the projection weights the stack reads

    def holds(self, linear: nn.Linear) -> bool:
        """Whether the stack reads this projection's weight."""
        return id(linear.weight) in self.weights

    def applies(self, input_ids: torch.Tensor, meta: object, lora: object) -> bool:
        """Whether this step takes the fused path (`meta`: the step's metadata, or one per
        layer with a hybrid KV cache)."""
        first = meta[0] if isinstance(meta, list) and meta else meta
        return (
            isinstance(first, AttentionMetadata)
            and lora is None
            and first.num_decodes == first.num_seqs == first.num_tokens
            and 0 < first.num_tokens <= MAX_ROWS
            and input_ids.device.type == "cpu"
            and not torch.compiler.is_compiling()
        )

    def run_layers(
        self,
        model: CausalLM,
        h: torch.Tensor,
        positions: torch.Tensor,
        kv_caches: list[torch.Tensor],
        meta: AttentionMetadata | list[AttentionMetadata],
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """(h, residual) after every layer: runs of fused layers as one call each, the others
        through their modules. With a hybrid KV cache (one metadata per layer: each group's block
        tables and slots) a run also ends where the next layer belongs to another group."""
        residual: torch.Tensor | None = None
        rope = None
        layers = model.model.layers
        per_layer = meta if isinstance(meta, list) else None
        i, n = 0, len(layers)
        while i < n:
            layer_meta = meta if per_layer is None else per_layer[i]
            assert isinstance(layer_meta, AttentionMetadata)
            first = self.index[i]
            if first is None:
                if rope is None:
                    rope = model.rope_for(positions)
                h, residual = layers[i](h, residual, rope, kv_caches[i], layer_meta, None)
                i += 1
                continue
            end = i + 1
            while end < n and self.index[end] is not None and (per_layer is None or per_layer[end] is layer_meta):
                end += 1
            h, residual = self.stack.forward(
                first,
                first + end - i,
                h,
                residual,
                kv_caches[i:end],
                positions,
                layer_meta.slot_mapping,
                layer_meta.block_tables,
                layer_meta.seq_lens_tensor,
            )
            i = end
        return h, residual


def build_fused_decode(model: CausalLM) -> FusedDecode | None:
    """The fused decode path for `model` (its weights loaded, before any packing), or None where
    no layer takes it: not on CPU, not float32/bfloat16, the native extension unavailable, turned
    off, or no layer qualifies."""
    if (
        fused_decode_disabled()
        or model.device.type != "cpu"
        or model.dtype not in _DTYPES
        or model.tp is not None
        or not len(model.model.layers)
    ):
        return None
    reasons = [layer_refusal(layer, model.dtype, model.rank_spec.intermediate_size) for layer in model.model.layers]
    fused: list[Any] = [layer for layer, why in zip(model.model.layers, reasons) if why is None]
    if not fused:
        return None
    ext = load_native()
    if ext is None:
        return None
    spec = model.rank_spec
    stack = ext.DecodeStack(
        spec.hidden_size,
        spec.num_heads,
        spec.num_kv_heads,
        spec.head_dim,
        spec.intermediate_size,
        float(spec.rms_norm_eps),
        spec.norm_kind is NormKind.GEMMA,
        spec.hidden_act == "gelu_pytorch_tanh",
        [_layer_tables(model, layer) for layer in fused],
        [[proj_arg(proj, model.dtype) for _, proj in _projections(layer)] for layer in fused],
        [_layer_params(layer) for layer in fused],
    )
    index: list[int | None] = []
    for why in reasons:
        index.append(None if why is not None else sum(1 for j in index if j is not None))
    held = frozenset(
        id(proj.weight) for layer in fused for _, proj in _projections(layer) if isinstance(proj, nn.Linear)
    )
    return FusedDecode(stack, index, reasons, held)
