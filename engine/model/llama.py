"""Llama-family decoder (Llama, Mistral, Qwen2) over a paged KV cache, written for inference.

Differences from the HF modules, all invisible in the numbers: q/k/v are one fused linear
(`qkv_proj`, rows q|k|v) and gate/up are one (`gate_up_proj`, rows gate|up); `load_weights`
maps the HF checkpoint names onto them. RoPE cos/sin are precomputed in float32 and stored in
the model dtype (HF casts them the same way), so float32 runs match HF to rounding.

As in vLLM, the residual stream travels beside the hidden states between layers, so that each
residual add fuses with the RMSNorm after it. With `fused_ops` (the CPU extension of
`kernels.cpu_fused_ops`) the add+norm, RoPE and SiLU-and-mul run as single C++ ops that round
exactly like the torch code they replace, so results are bit-identical either way.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import TYPE_CHECKING, Any

import torch
import torch.nn.functional as F
from torch import nn

from engine.attention.backend import AttentionBackend
from engine.attention.compiled_op import AttentionStep
from engine.attention.metadata import AttentionMetadata
from engine.lora.punica import LoRABatch, LoRALayer
from engine.model.llama_spec import LlamaSpec, rope_inv_freq
from engine.model.quant_linear import (
    HEAD_WEIGHT_ONLY_MAX_ROWS,
    Int4Linear,
    Int8Embedding,
    Int8Linear,
    QuantMethod,
    make_quant_linear,
    unpack_nibbles,
)
from engine.model.quant_spec import QUANT_LEAVES, QuantSpec
from kernels.cpu_fused_ops import CpuFusedOps
from kernels.cpu_int4_dequant import load_int4_dequant
from kernels.cpu_int8_mm_io import load_int8_mm_io
from kernels.cpu_packed_linear import PackedLinear
from kernels.cpu_upcast_linear import UpcastLinear

if TYPE_CHECKING:
    from engine.parallel.group import TensorParallelGroup

# HF projection name -> (fused module name, shard index).
_FUSED = {
    "q_proj": ("qkv_proj", 0),
    "k_proj": ("qkv_proj", 1),
    "v_proj": ("qkv_proj", 2),
    "gate_proj": ("gate_up_proj", 0),
    "up_proj": ("gate_up_proj", 1),
}
_QUANT_LINEARS = (Int8Linear, Int4Linear)
_UNFUSED = {"qkv_proj": ("q_proj", "k_proj", "v_proj"), "gate_up_proj": ("gate_proj", "up_proj")}


class RMSNorm(nn.Module):
    """HF LlamaRMSNorm: normalise in float32, cast back, then scale by the weight.

    `forward(x)` returns the norm; `forward(x, residual)` first adds `x` to the residual stream
    and returns `(norm(residual + x), residual + x)` (the fused op updates `residual` in place).
    """

    def __init__(self, size: int, eps: float, dtype: torch.dtype, ops: CpuFusedOps | None = None) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.empty(size, dtype=dtype))
        self.eps = eps
        self.ops = ops

    def forward(
        self, x: torch.Tensor, residual: torch.Tensor | None = None
    ) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
        ops = eager_ops(self.ops)
        if residual is None:
            return ops.rms_norm(x, self.weight, self.eps) if ops else self._norm(x)
        if ops:
            return ops.fused_add_rms_norm(x, residual, self.weight, self.eps), residual
        residual = residual + x
        return self._norm(residual), residual

    def _norm(self, x: torch.Tensor) -> torch.Tensor:
        h = x.float()
        h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * h.to(x.dtype)


def eager_ops(ops: CpuFusedOps | None) -> CpuFusedOps | None:
    """The fused ops, or None while torch.compile traces (inductor fuses the torch glue itself;
    the extension's calls cannot be traced)."""
    return None if ops is None or torch.compiler.is_compiling() else ops


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate-half RoPE of `x [T, heads, head_dim]` with `cos`/`sin [T, 1, head_dim // 2]`."""
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1)


class LlamaAttention(nn.Module):
    def __init__(
        self, spec: LlamaSpec, dtype: torch.dtype, backend: AttentionBackend, ops: CpuFusedOps | None = None
    ) -> None:
        super().__init__()
        self.num_heads, self.num_kv_heads, self.head_dim = spec.num_heads, spec.num_kv_heads, spec.head_dim
        q_size, kv_size = spec.num_heads * spec.head_dim, spec.num_kv_heads * spec.head_dim
        self.qkv_proj = nn.Linear(spec.hidden_size, q_size + 2 * kv_size, bias=spec.qkv_bias, dtype=dtype)
        self.o_proj = nn.Linear(q_size, spec.hidden_size, bias=spec.o_bias, dtype=dtype)
        self.scale = spec.head_dim**-0.5
        self.backend = backend
        self.ops = ops
        # Tensor parallelism (engine.parallel.layers): sums the ranks' partial o_proj outputs.
        self.reduce: Callable[[torch.Tensor], torch.Tensor] | None = None

    def forward(
        self, h: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, kv_cache: torch.Tensor,
        meta: AttentionMetadata | AttentionStep,
        lora: LoRALayer | None = None,
    ) -> torch.Tensor:
        num_tokens = h.shape[0]
        qkv = self.qkv_proj(h)
        if lora is not None:
            lora.add("qkv", h, qkv)
        qk_heads = self.num_heads + self.num_kv_heads
        # RoPE on q and k together: one pass over [T, heads + kv_heads, head_dim].
        qk = qkv[:, : qk_heads * self.head_dim].view(num_tokens, qk_heads, self.head_dim)
        ops = eager_ops(self.ops)
        qk = ops.rotary_embedding_(qk, cos, sin) if ops else apply_rope(qk, cos, sin)
        q, k = qk[:, : self.num_heads], qk[:, self.num_heads :]
        v = qkv[:, qk_heads * self.head_dim :].view(num_tokens, self.num_kv_heads, self.head_dim)
        if isinstance(meta, AttentionStep):  # a compiled forward: one opaque op (engine.attention.compiled_op)
            out = torch.ops.pagedserve.paged_attention(q, k, v, kv_cache, meta, self.scale)
        else:
            out = self.backend.forward(q, k, v, kv_cache, meta, self.scale)
        out = out.reshape(num_tokens, -1)
        out = self.o_proj(out) if lora is None else lora.add("o", out, self.o_proj(out))
        return out if self.reduce is None else self.reduce(out)


class LlamaMLP(nn.Module):
    def __init__(self, spec: LlamaSpec, dtype: torch.dtype, ops: CpuFusedOps | None = None) -> None:
        super().__init__()
        size = spec.intermediate_size
        self.gate_up_proj = nn.Linear(spec.hidden_size, 2 * size, bias=spec.mlp_bias, dtype=dtype)
        self.down_proj = nn.Linear(size, spec.hidden_size, bias=spec.mlp_bias, dtype=dtype)
        self.ops = ops
        # Tensor parallelism (engine.parallel.layers): sums the ranks' partial down_proj outputs.
        self.reduce: Callable[[torch.Tensor], torch.Tensor] | None = None

    def forward(self, h: torch.Tensor, lora: LoRALayer | None = None) -> torch.Tensor:
        gate_up = self.gate_up_proj(h)
        if lora is not None:
            lora.add("gate_up", h, gate_up)
        ops = eager_ops(self.ops)
        if ops:
            act = ops.silu_and_mul(gate_up)
        else:
            gate, up = gate_up.chunk(2, dim=-1)
            act = F.silu(gate) * up
        out = self.down_proj(act) if lora is None else lora.add("down", act, self.down_proj(act))
        return out if self.reduce is None else self.reduce(out)


class LlamaDecoderLayer(nn.Module):
    def __init__(
        self, spec: LlamaSpec, dtype: torch.dtype, backend: AttentionBackend, ops: CpuFusedOps | None = None
    ) -> None:
        super().__init__()
        self.input_layernorm = RMSNorm(spec.hidden_size, spec.rms_norm_eps, dtype, ops)
        self.self_attn = LlamaAttention(spec, dtype, backend, ops)
        self.post_attention_layernorm = RMSNorm(spec.hidden_size, spec.rms_norm_eps, dtype, ops)
        self.mlp = LlamaMLP(spec, dtype, ops)

    def forward(
        self,
        h: torch.Tensor,
        residual: torch.Tensor | None,
        cos: torch.Tensor,
        sin: torch.Tensor,
        kv_cache: torch.Tensor,
        meta: AttentionMetadata | AttentionStep,
        lora: LoRALayer | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """`h` is the previous layer's MLP output, not yet added to `residual` (None: first layer,
        `h` is the embedding). Returns this layer's (MLP output, residual before adding it).
        `lora`: the step's adapters for this layer (engine.lora.punica), None for none."""
        if residual is None:
            residual, h = h, self.input_layernorm(h)
        else:
            h, residual = self.input_layernorm(h, residual)
        h = self.self_attn(h, cos, sin, kv_cache, meta, lora)
        h, residual = self.post_attention_layernorm(h, residual)
        return self.mlp(h, lora), residual


class LlamaModel(nn.Module):
    def __init__(
        self, spec: LlamaSpec, dtype: torch.dtype, backend: AttentionBackend, ops: CpuFusedOps | None = None
    ) -> None:
        super().__init__()
        # Given its (empty) weight, nn.Embedding skips its random init: on the meta device that
        # init alone imports torch._dynamo (seconds of every worker's start); load_weights fills it.
        weight = torch.empty(spec.vocab_size, spec.hidden_size, dtype=dtype)
        self.embed_tokens = nn.Embedding(spec.vocab_size, spec.hidden_size, _weight=weight)
        self.layers = nn.ModuleList(LlamaDecoderLayer(spec, dtype, backend, ops) for _ in range(spec.num_layers))
        self.norm = RMSNorm(spec.hidden_size, spec.rms_norm_eps, dtype, ops)


class LlamaForCausalLM(nn.Module):
    """Llama / Mistral / Qwen2 causal LM. Weights start uninitialised: fill them with `load_weights`.

    `max_model_len` (default: the config's max_position_embeddings) bounds the RoPE table; a
    sliding window shorter than it is refused (the backends attend to the whole context).
    `fused_ops` (CPU, float32/bfloat16 only) replaces the elementwise glue with fused C++ ops.
    `quant` swaps the projections, the embedding and the LM head for quantized layers (see
    engine.model.quant_spec for which); they are filled by `load_weights` from full-precision
    tensors (quantized one tensor at a time) or from a quantized checkpoint's tensors.
    `tp` makes this model one rank's shard of a tensor-parallel model (engine.parallel): its
    modules are sized by `rank_spec` (its heads, MLP and vocabulary slices; `spec` stays the
    whole model's), `load_weights` expects the rank's slices, and `compute_logits` returns the
    whole vocabulary on rank 0 and None on the others.
    """

    def __init__(
        self,
        config: Any,
        dtype: torch.dtype,
        device: str | torch.device,
        backend: AttentionBackend,
        max_model_len: int | None = None,
        fused_ops: CpuFusedOps | None = None,
        quant: QuantSpec | None = None,
        tp: TensorParallelGroup | None = None,
    ) -> None:
        super().__init__()
        spec = config if isinstance(config, LlamaSpec) else LlamaSpec.from_hf(config)
        self.tp = tp
        if tp is None:
            self.rank_spec = spec
        else:
            from engine.parallel.sharding import shard_spec

            self.rank_spec = shard_spec(spec, tp.size)
        max_len = max_model_len or spec.max_position_embeddings
        if spec.sliding_window is not None and spec.sliding_window < max_len:
            raise ValueError(
                f"{spec.architecture} uses a sliding window of {spec.sliding_window} tokens, which is not "
                f"supported; it only works when max_model_len <= {spec.sliding_window} (got {max_len})"
            )
        self.spec, self.dtype, self.device, self.max_model_len = spec, dtype, torch.device(device), max_len
        local = self.rank_spec
        with torch.device("meta"):
            self.model = LlamaModel(local, dtype, backend, fused_ops)
            self.lm_head = None
            if not spec.tie_word_embeddings:
                self.lm_head = nn.Linear(spec.hidden_size, local.vocab_size, bias=False, dtype=dtype)
            if quant is not None and quant.method is not QuantMethod.NONE:
                self._swap_quantized(quant)
            if tp is not None:
                from engine.parallel.layers import parallelize

                parallelize(self.model, tp, local.vocab_size)
        # to_empty's empty_like on meta tensors goes through torch's Python refs, whose first use
        # imports sympy (~1-2 s of a worker's start); a plain empty of each shape does not.
        self._apply(lambda t: torch.empty(t.shape, dtype=t.dtype, device=self.device))
        self.requires_grad_(False)
        # pack_linear_weights(), or (quantized, tied) an Int8Linear over the embedding's storage
        self.packed_lm_head: PackedLinear | UpcastLinear | Int8Linear | None = None
        freqs = torch.arange(max_len, dtype=torch.float32, device=self.device)[:, None] * rope_inv_freq(spec).to(
            self.device
        )
        # [max_len, head_dim // 2] each, stored in the model dtype like HF's cast before use.
        self.register_buffer("rope_cos", freqs.cos().to(dtype), persistent=False)
        self.register_buffer("rope_sin", freqs.sin().to(dtype), persistent=False)
        self._shard_sizes = {
            "qkv_proj": [local.num_heads * local.head_dim] + [local.num_kv_heads * local.head_dim] * 2,
            "gate_up_proj": [local.intermediate_size] * 2,
        }

    def forward(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        kv_caches: list[torch.Tensor],
        meta: AttentionMetadata | AttentionStep,
        lora: LoRABatch | None = None,
    ) -> torch.Tensor:
        """Run `input_ids [T]` at `positions [T]` (int64); returns final-normed hidden states [T, hidden].
        `meta`: the step's AttentionMetadata, or under torch.compile an AttentionStep (attention
        then runs as one opaque custom op, engine.attention.compiled_op).
        `lora`: each row's LoRA adapter slot and the resident adapters (None: the base model only)."""
        if len(kv_caches) != self.spec.num_layers:
            raise ValueError(f"expected {self.spec.num_layers} KV caches, got {len(kv_caches)}")
        h = self.model.embed_tokens(input_ids)
        cos, sin = self.rope_cos[positions].unsqueeze(1), self.rope_sin[positions].unsqueeze(1)
        residual = None
        for i, (layer, kv_cache) in enumerate(zip(self.model.layers, kv_caches)):
            h, residual = layer(h, residual, cos, sin, kv_cache, meta, None if lora is None else lora.layer(i))
        if residual is None:  # no layers
            return self.model.norm(h)
        return self.model.norm(h, residual)[0]

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor | None:
        """`hidden [N, hidden]` -> logits `[N, vocab]` in the model dtype (the sampler widens
        them to float32 only when it needs to). Tensor-parallel: each rank computes its slice of
        the vocabulary; rank 0 gets them gathered, the other ranks None."""
        logits = self._rank_logits(hidden)
        return logits if self.tp is None else self.tp.gather_vocab(logits)

    def _rank_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        if self.packed_lm_head is not None:
            return self.packed_lm_head(hidden)
        if isinstance(self.lm_head, Int8Linear):
            return self.lm_head(hidden)
        weight = self.model.embed_tokens.weight if self.lm_head is None else self.lm_head.weight
        return F.linear(hidden, weight)

    def _projections(self) -> Iterable[tuple[str, nn.Module, str]]:
        """(qualified name, parent module, attribute) of every decoder projection."""
        for i, layer in enumerate(self.model.layers):
            for part, parent, name in (
                ("self_attn", layer.self_attn, "qkv_proj"), ("self_attn", layer.self_attn, "o_proj"),
                ("mlp", layer.mlp, "gate_up_proj"), ("mlp", layer.mlp, "down_proj"),
            ):
                yield f"model.layers.{i}.{part}.{name}", parent, name

    def _swap_quantized(self, quant: QuantSpec) -> None:
        """Replace (on the meta device, before allocation) the projections, the embedding and
        an untied LM head by quantized layers; nothing full-precision is ever allocated for them."""
        methods = {quant.method_for(q) for q, _, _ in self._projections()}
        on_cpu = self.device.type == "cpu"
        int4_dequant = load_int4_dequant() if on_cpu and QuantMethod.INT4 in methods else None
        int8_mm_io = load_int8_mm_io() if on_cpu and methods & {QuantMethod.INT8, QuantMethod.W8A8} else None
        for qualified, parent, name in self._projections():
            linear = getattr(parent, name)
            method = quant.method_for(qualified)
            if method is not QuantMethod.NONE:
                setattr(parent, name, make_quant_linear(method, linear.in_features, linear.out_features,
                                                        linear.bias is not None, self.dtype, quant.group_size,
                                                        int4_dequant, int8_mm_io))
        emb = self.model.embed_tokens
        self.model.embed_tokens = Int8Embedding(emb.num_embeddings, emb.embedding_dim, self.dtype)
        if self.lm_head is not None:
            self.lm_head = Int8Linear(self.lm_head.in_features, self.lm_head.out_features, False, self.dtype,
                                      weight_only_max_rows=HEAD_WEIGHT_ONLY_MAX_ROWS)

    def pack_linear_weights(self, make: Callable[[torch.Tensor, torch.Tensor | None], nn.Module] = PackedLinear) -> None:
        """Swap every bf16 projection and the LM head for a CPU linear layer (after the weights
        are loaded): a PackedLinear (oneDNN then skips its per-call weight reorder) or, on a CPU
        without bf16 dot products, an UpcastLinear (float32 GEMMs). Quantized layers stay."""
        for _, parent, name in self._projections():
            if isinstance(getattr(parent, name), nn.Linear):
                linear = getattr(parent, name)
                setattr(parent, name, make(linear.weight, linear.bias))
        if self.packed_lm_head is not None or isinstance(self.lm_head, Int8Linear):
            return
        if self.lm_head is None:  # tied: the embedding keeps its plain table for lookups
            self.packed_lm_head = make(self.model.embed_tokens.weight, None)
        else:
            self.packed_lm_head = make(self.lm_head.weight, self.lm_head.bias)
            self.lm_head = None

    def checkpoint_names(self) -> set[str]:
        """The HF tensor names a checkpoint must provide (rotary inv_freq buffers never needed)."""
        names = set()
        quantized = [f"{m}.weight" for m, mod in self.named_modules()
                     if isinstance(mod, (Int8Embedding, *_QUANT_LINEARS)) and mod is not self.packed_lm_head]
        for name in [n for n, _ in self.named_parameters()] + quantized:
            module, leaf = name.rsplit(".", 1)
            parent, _, proj = module.rpartition(".")
            if proj not in _UNFUSED:
                names.add(name)
            else:
                names.update(f"{parent}.{part}.{leaf}" for part in _UNFUSED[proj])
        return names

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        """Copy HF-named tensors into the (fused) parameters, casting to the model dtype.

        Raises ValueError on a shape mismatch, on names the model does not have and on any
        expected tensor that never arrived. Ignores `*rotary_emb.inv_freq` and, when the
        embeddings are tied, a redundant `lm_head.weight`.
        """
        params = dict(self.named_parameters())
        expected = self.checkpoint_names()
        seen: set[str] = set()
        unexpected: list[str] = []
        pending: dict[str, dict[str, torch.Tensor]] = {}  # quantized tensors waiting for their parts
        for name, tensor in weights:
            base, _, leaf = name.rpartition(".")
            if leaf in QUANT_LEAVES:
                name, parts = f"{base}.weight", pending.setdefault(f"{base}.weight", {})
                parts[leaf] = tensor
            if name.endswith("rotary_emb.inv_freq") or (name == "lm_head.weight" and self.lm_head is None):
                continue
            if name not in expected:
                unexpected.append(name)
                continue
            target = self._quant_target(name)
            if target is not None:
                if self._load_quantized(name, target, pending.get(name), tensor):
                    pending.pop(name, None)
                    seen.add(name)
                continue
            dest = self._destination(name, params)
            if dest.shape != tensor.shape:
                raise ValueError(f"tensor {name} has shape {tuple(tensor.shape)}, expected {tuple(dest.shape)}")
            dest.copy_(tensor)
            seen.add(name)
        if unexpected:
            raise ValueError(f"unexpected tensors in checkpoint: {', '.join(sorted(unexpected)[:20])}")
        missing = expected - seen
        if missing:
            raise ValueError(f"tensors missing from checkpoint: {', '.join(sorted(missing)[:20])}")
        emb = self.model.embed_tokens
        if isinstance(emb, Int8Embedding) and self.lm_head is None:
            self.packed_lm_head = Int8Linear.sharing(emb.qweight, emb.scale, self.dtype)

    def _quant_target(self, name: str) -> tuple[nn.Module, int, int] | None:
        """For an HF weight name held by a quantized layer: (layer, first row, row count)."""
        module, leaf = name.rsplit(".", 1)
        if leaf != "weight":
            return None
        parent, _, proj = module.rpartition(".")
        fused, shard = _FUSED.get(proj, (proj, 0))
        layer = self.get_submodule(f"{parent}.{fused}" if parent else fused)
        if not isinstance(layer, (Int8Embedding, *_QUANT_LINEARS)):
            return None
        if fused not in self._shard_sizes:
            return layer, 0, layer.qweight.shape[0] if isinstance(layer, Int8Embedding) else layer.out_features
        sizes = self._shard_sizes[fused]
        return layer, sum(sizes[:shard]), sizes[shard]

    def _load_quantized(self, name: str, target: tuple[nn.Module, int, int],
                        parts: dict[str, torch.Tensor] | None, tensor: torch.Tensor) -> bool:
        """Fill rows of a quantized layer from a full-precision weight (quantized here) or from a
        quantized checkpoint's parts once all have arrived; True when the rows are filled."""
        layer, start, rows = target
        needed = ("qweight", "scales", "offsets") if isinstance(layer, Int4Linear) else ("qweight", "scales")
        if parts is None:  # a full-precision weight
            if tensor.dim() != 2 or tensor.shape[0] != rows or not tensor.is_floating_point():
                raise ValueError(f"tensor {name} has shape {tuple(tensor.shape)} and dtype {tensor.dtype}, "
                                 f"expected a floating-point weight of {rows} rows")
            if isinstance(layer, Int8Embedding):
                layer.set_weight(tensor)
            else:
                layer.quantize_rows(start, tensor)
            return True
        if not all(k in parts for k in needed):
            return False
        if set(parts) - set(needed):
            raise ValueError(f"{name}: unexpected quantized parts {sorted(set(parts) - set(needed))} "
                             f"for a {type(layer).__name__}")
        q, scales = parts["qweight"], parts["scales"]
        if q.shape[0] != rows:
            raise ValueError(f"{name}.qweight has {q.shape[0]} rows, expected {rows}")
        if isinstance(layer, Int8Embedding):
            layer.set_quantized(q, scales)
        elif isinstance(layer, Int4Linear):
            if q.dtype != torch.uint8:
                raise ValueError(f"{name}.qweight must be uint8 int4 codes for an int4 layer, got {q.dtype}")
            layer.set_rows(start, unpack_nibbles(q), scales, parts["offsets"])
        else:
            if q.dtype != torch.int8:
                raise ValueError(f"{name}.qweight must be int8 for an int8 layer, got {q.dtype}")
            layer.set_rows(start, q, scales)
        return True

    def _destination(self, name: str, params: dict[str, nn.Parameter]) -> torch.Tensor:
        module, leaf = name.rsplit(".", 1)
        parent, _, proj = module.rpartition(".")
        if proj not in _FUSED:
            return params[name]
        fused, shard = _FUSED[proj]
        sizes = self._shard_sizes[fused]
        return params[f"{parent}.{fused}.{leaf}"].narrow(0, sum(sizes[:shard]), sizes[shard])
