"""The causal LM every family builds on: the decoder stack of pagedserve.engine.model.layers, the LM head,
RoPE tables, quantized layers, packing for CPU, and checkpoint loading by HF name.

A family (pagedserve.engine.model.registry) is a subclass that says only what differs: its decoder layer
class, its MLP (a mixture of experts), whether its checkpoint already fuses q/k/v and gate/up.

Differences from the HF modules, all invisible in the numbers: q/k/v are one fused linear
(`qkv_proj`, rows q|k|v) and gate/up are one (`gate_up_proj`, rows gate|up); `load_weights`
maps the HF checkpoint names onto them. RoPE cos/sin are precomputed in float32 and stored in
the model dtype (HF casts them the same way), so float32 runs match HF to rounding. With
`fused_ops` (the CPU extension of `pagedserve.kernels.cpu_fused_ops`) the add+norm, RoPE and SiLU-and-mul
run as single C++ ops that round exactly like the torch code they replace.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import TYPE_CHECKING, Any, Protocol

import torch
import torch.nn.functional as F
from torch import nn

from pagedserve.engine.attention.backend import AttentionBackend
from pagedserve.engine.attention.compiled_op import AttentionStep
from pagedserve.engine.attention.metadata import AttentionMetadata
from pagedserve.engine.lora.punica import LoRABatch
from pagedserve.engine.model.layers.decoder import (
    DecoderLayer,
    DecoderModel,
    MakeMLP,
    SandwichDecoderLayer,
    dense_mlp,
)
from pagedserve.engine.model.layers.rotary import rope_tables
from pagedserve.engine.model.quant_linear import (
    HEAD_WEIGHT_ONLY_MAX_ROWS,
    Int4Linear,
    Int8Embedding,
    Int8Linear,
    QuantMethod,
    make_quant_linear,
    unpack_nibbles,
)
from pagedserve.engine.model.quant_spec import QUANT_LEAVES, QuantSpec
from pagedserve.engine.model.spec import ModelSpec
from pagedserve.kernels.cpu_fused_ops import CpuFusedOps
from pagedserve.kernels.cpu_int4_dequant import load_int4_dequant
from pagedserve.kernels.cpu_int8_mm_io import load_int8_mm_io
from pagedserve.kernels.cpu_packed_linear import PackedLinear

if TYPE_CHECKING:
    from pagedserve.engine.model.layers.parallel import RankGroup

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
_PROJECTION_NAMES = ("qkv_proj", "o_proj", "gate_up_proj", "down_proj")


class DecodeShortcut(Protocol):
    """A faster path for some steps' layers (pagedserve.engine.model.fused_decode.FusedDecode,
    which imports this module: the model names only what it calls)."""

    def applies(self, input_ids: torch.Tensor, meta: object, lora: object) -> bool: ...

    def run_layers(
        self, model: CausalLM, h: torch.Tensor, positions: torch.Tensor, kv_caches: list[torch.Tensor], meta: Any
    ) -> tuple[torch.Tensor, torch.Tensor | None]: ...


class CausalLM(nn.Module):
    """A decoder-only causal LM. Weights start uninitialised: fill them with `load_weights`.

    `spec`: the ModelSpec (an HF config parsed by its family: pagedserve.engine.model.registry.parse_config).
    `max_model_len` (default: the config's max_position_embeddings) bounds the RoPE tables.
    `fused_ops` (CPU, float32/bfloat16 only) replaces the elementwise glue with fused C++ ops.
    `quant` swaps the projections, the embedding and the LM head for quantized layers (see
    pagedserve.engine.model.quant_spec for which); they are filled by `load_weights` from full-precision
    tensors (quantized one tensor at a time) or from a quantized checkpoint's tensors.
    `tp` makes this model one rank's shard of a tensor-parallel model (pagedserve.engine.parallel): its
    modules are sized by `rank_spec` (its heads, MLP and vocabulary slices; `spec` stays the
    whole model's), `load_weights` expects the rank's slices, and `compute_logits` returns the
    whole vocabulary on rank 0 and None on the others.
    """

    # What a family changes (class constants, never changed at run time): its decoder layer, its
    # MLP factory, and whether its checkpoint already holds `qkv_proj` / `gate_up_proj` (Phi-3).
    layer_cls: type[nn.Module] = DecoderLayer
    make_mlp: MakeMLP = staticmethod(dense_mlp)
    checkpoint_fused: bool = False

    def __init__(
        self,
        spec: ModelSpec,
        dtype: torch.dtype,
        device: str | torch.device,
        backend: AttentionBackend,
        max_model_len: int | None = None,
        fused_ops: CpuFusedOps | None = None,
        quant: QuantSpec | None = None,
        tp: RankGroup | None = None,
    ) -> None:
        super().__init__()
        if not isinstance(spec, ModelSpec):
            raise TypeError(
                f"{type(self).__name__} takes a ModelSpec (pagedserve.engine.model.registry.parse_config), "
                f"got {type(spec).__name__}"
            )
        self.tp = tp
        if tp is None:
            self.rank_spec = spec
        else:
            from pagedserve.engine.model.sharding import shard_spec

            self.rank_spec = shard_spec(spec, tp.size)
        max_len = max_model_len or spec.max_position_embeddings
        self.spec, self.dtype, self.device, self.max_model_len = spec, dtype, torch.device(device), max_len
        local = self.rank_spec
        self.head_io: Any = None  # the native extension for an int8 head (set with quantized layers)
        with torch.device("meta"):
            self.model = DecoderModel(local, dtype, backend, fused_ops, self.layer_cls, self.make_mlp)
            self.lm_head: nn.Linear | Int8Linear | None = None
            if not spec.tie_word_embeddings:
                self.lm_head = nn.Linear(spec.hidden_size, local.vocab_size, bias=False, dtype=dtype)
            if quant is not None and quant.method is not QuantMethod.NONE:
                self._swap_quantized(quant)
            if tp is not None:
                from pagedserve.engine.model.layers.parallel import parallelize

                parallelize(self.model, tp, local.vocab_size)
        # to_empty's empty_like on meta tensors goes through torch's Python refs, whose first use
        # imports sympy (~1-2 s of a worker's start); a plain empty of each shape does not.
        self._apply(lambda t: torch.empty(t.shape, dtype=t.dtype, device=self.device))
        self.requires_grad_(False)
        # pack_linear_weights(), or (quantized, tied) an Int8Linear over the embedding's storage
        self.packed_lm_head: nn.Module | None = None  # PackedLinear, UpcastLinear or Int8Linear
        # {table: (cos, sin)}, [max_len, head_dim // 2] each, in the model dtype like HF's cast before use.
        tables = rope_tables(spec, max_len, dtype, self.device)
        self.rope_names = tuple(tables)
        for name, (cos, sin) in tables.items():
            self.register_buffer(f"rope_{name}_cos", cos, persistent=False)
            self.register_buffer(f"rope_{name}_sin", sin, persistent=False)
        self.embed_scale = (
            None if spec.embed_scale is None else torch.tensor(spec.embed_scale).to(dtype=dtype, device=self.device)
        )
        self._qkv_sizes = [local.num_heads * local.head_dim] + [local.num_kv_heads * local.head_dim] * 2
        # Decode steps as one C++ call per run of layers (pagedserve.engine.model.fused_decode); set by the loader.
        self.fused_decode: DecodeShortcut | None = None

    def forward(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        kv_caches: list[torch.Tensor],
        meta: AttentionMetadata | AttentionStep | list[AttentionMetadata],
        lora: LoRABatch | None = None,
    ) -> torch.Tensor:
        """Run `input_ids [T]` at `positions [T]` (int64); returns final-normed hidden states [T, hidden].
        `meta`: the step's AttentionMetadata, or under torch.compile an AttentionStep (attention
        then runs as one opaque custom op, pagedserve.engine.attention.compiled_op), or one
        AttentionMetadata per layer (a hybrid KV cache: each layer its group's block tables).
        `lora`: each row's LoRA adapter slot and the resident adapters (None: the base model only)."""
        if len(kv_caches) != self.spec.num_layers:
            raise ValueError(f"expected {self.spec.num_layers} KV caches, got {len(kv_caches)}")
        h = self.model.embed_tokens(input_ids)
        if self.embed_scale is not None:
            h = h * self.embed_scale
        fused = self.fused_decode
        if fused is not None and fused.applies(input_ids, meta, lora):
            h, residual = fused.run_layers(self, h, positions, kv_caches, meta)
        else:
            rope = self.rope_for(positions)
            residual = None
            per_layer = meta if isinstance(meta, list) else None
            for i, (layer, kv_cache) in enumerate(zip(self.model.layers, kv_caches)):
                layer_meta = meta if per_layer is None else per_layer[i]
                h, residual = layer(h, residual, rope, kv_cache, layer_meta, None if lora is None else lora.layer(i))
        if residual is None:  # no layers
            return self.model.norm(h)
        return self.model.norm(h, residual)[0]

    def rope_for(self, positions: torch.Tensor) -> dict[str, tuple[torch.Tensor, torch.Tensor]]:
        """Each RoPE table's (cos, sin) rows at `positions`, as `[T, 1, head_dim // 2]`."""
        return {
            name: (
                getattr(self, f"rope_{name}_cos")[positions].unsqueeze(1),
                getattr(self, f"rope_{name}_sin")[positions].unsqueeze(1),
            )
            for name in self.rope_names
        }

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor | None:
        """`hidden [N, hidden]` -> logits `[N, vocab]` in the model dtype (the sampler widens
        them to float32 only when it needs to). Tensor-parallel: each rank computes its slice of
        the vocabulary; rank 0 gets them gathered, the other ranks None."""
        rank_logits = self._rank_logits(hidden)
        logits = rank_logits if self.tp is None else self.tp.gather_vocab(rank_logits)
        cap = self.spec.final_softcap
        if cap is not None and logits is not None:
            logits = torch.tanh(logits / cap) * cap
        return logits

    def _rank_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        if self.packed_lm_head is not None:
            return self.packed_lm_head(hidden)
        if isinstance(self.lm_head, Int8Linear):
            return self.lm_head(hidden)
        return F.linear(hidden, self._embedding_weight() if self.lm_head is None else self.lm_head.weight)

    def _embedding_weight(self) -> torch.Tensor:
        """The (tied) embedding's table: nn.Embedding's, or a tensor-parallel rank's slice."""
        weight = self.model.embed_tokens.weight
        assert isinstance(weight, torch.Tensor), "an int8 embedding's head is the packed Int8Linear"
        return weight

    def _projections(self) -> list[tuple[str, nn.Module, str]]:
        """(qualified name, parent module, attribute) of every decoder projection: attention's
        qkv/o, and gate_up/down of each MLP (the dense one, or each expert and a shared expert)."""
        return [
            (f"{qualified}.{name}", module, name)
            for qualified, module in self.model.layers.named_modules(prefix="model.layers")
            for name in _PROJECTION_NAMES
            if isinstance(getattr(module, name, None), nn.Module)
        ]

    def _swap_quantized(self, quant: QuantSpec) -> None:
        """Replace (on the meta device, before allocation) the projections, the embedding and
        an untied LM head by quantized layers; nothing full-precision is ever allocated for them."""
        methods = {quant.method_for(q) for q, _, _ in self._projections()}
        on_cpu = self.device.type == "cpu"
        int4_dequant = load_int4_dequant() if on_cpu and QuantMethod.INT4 in methods else None
        int8_mm_io = load_int8_mm_io() if on_cpu and methods & {QuantMethod.INT8, QuantMethod.W8A8} else None
        # The int8 embedding's head (tied or not) runs the native few-row int8 GEMV where it is built.
        self.head_io = load_int8_mm_io() if on_cpu else None
        for qualified, parent, name in self._projections():
            linear = getattr(parent, name)
            method = quant.method_for(qualified)
            if method is not QuantMethod.NONE:
                setattr(
                    parent,
                    name,
                    make_quant_linear(
                        method,
                        linear.in_features,
                        linear.out_features,
                        linear.bias is not None,
                        self.dtype,
                        quant.group_size,
                        int4_dequant,
                        int8_mm_io,
                    ),
                )
        emb = self.model.embed_tokens
        assert isinstance(emb, nn.Embedding)  # quantized before parallelize() replaces it
        self.model.embed_tokens = Int8Embedding(emb.num_embeddings, emb.embedding_dim, self.dtype)
        if self.lm_head is not None:
            self.lm_head = Int8Linear(
                self.lm_head.in_features,
                self.lm_head.out_features,
                False,
                self.dtype,
                weight_only_max_rows=HEAD_WEIGHT_ONLY_MAX_ROWS,
                io=self.head_io,
            )

    def pack_linear_weights(
        self,
        make: Callable[[torch.Tensor, torch.Tensor | None], nn.Module] = PackedLinear,
        keep_plain: Callable[[nn.Linear], bool] | None = None,
        make_tied: Callable[[torch.Tensor], nn.Module] | None = None,
    ) -> None:
        """Swap every bf16 projection and the LM head for a CPU linear layer (after the weights
        are loaded): a PackedLinear (oneDNN then skips its per-call weight reorder) or, on a CPU
        without bf16 dot products, an UpcastLinear (float32 GEMMs). Quantized layers stay, and so
        do the projections `keep_plain` names (the fused decode layers read their plain weights:
        a packed copy beside them would hold the weights twice). A tied head is built by
        `make_tied(embedding weight)` when given (a layer that reads the embedding's own table,
        e.g. SharedWeightLinear: one copy serves the lookups and the head), else by `make`
        (which must not copy it: UpcastLinear keeps the tensor it gets)."""
        for _, parent, name in self._projections():
            linear = getattr(parent, name)
            if isinstance(linear, nn.Linear) and (keep_plain is None or not keep_plain(linear)):
                setattr(parent, name, make(linear.weight, linear.bias))
        if self.packed_lm_head is not None or isinstance(self.lm_head, Int8Linear):
            return
        if self.lm_head is None:  # tied: the embedding keeps its plain table for lookups
            weight = self._embedding_weight()
            self.packed_lm_head = make(weight, None) if make_tied is None else make_tied(weight)
        else:
            self.packed_lm_head = make(self.lm_head.weight, self.lm_head.bias)
            self.lm_head = None

    def checkpoint_names(self) -> set[str]:
        """The HF tensor names a checkpoint must provide (rotary inv_freq buffers never needed)."""
        names = set()
        quantized = [
            f"{m}.weight"
            for m, mod in self.named_modules()
            if isinstance(mod, (Int8Embedding, *_QUANT_LINEARS)) and mod is not self.packed_lm_head
        ]
        for name in [n for n, _ in self.named_parameters()] + quantized:
            module, leaf = name.rsplit(".", 1)
            parent, _, proj = module.rpartition(".")
            if proj not in _UNFUSED or self.checkpoint_fused:
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
            self.packed_lm_head = Int8Linear.sharing(emb.qweight, emb.scale, self.dtype, io=self.head_io)

    def _quant_target(self, name: str) -> tuple[Int8Embedding | Int8Linear | Int4Linear, int, int] | None:
        """For an HF weight name held by a quantized layer: (layer, first row, row count)."""
        module, leaf = name.rsplit(".", 1)
        if leaf != "weight":
            return None
        parent, _, proj = module.rpartition(".")
        fused, shard = (proj, 0) if self.checkpoint_fused else _FUSED.get(proj, (proj, 0))
        layer = self.get_submodule(f"{parent}.{fused}" if parent else fused)
        if not isinstance(layer, (Int8Embedding, *_QUANT_LINEARS)):
            return None
        rows = layer.qweight.shape[0] if isinstance(layer, Int8Embedding) else layer.out_features
        if fused not in _UNFUSED or self.checkpoint_fused:
            return layer, 0, rows
        sizes = self._fused_sizes(rows, fused)
        return layer, sum(sizes[:shard]), sizes[shard]

    def _load_quantized(
        self,
        name: str,
        target: tuple[Int8Embedding | Int8Linear | Int4Linear, int, int],
        parts: dict[str, torch.Tensor] | None,
        tensor: torch.Tensor,
    ) -> bool:
        """Fill rows of a quantized layer from a full-precision weight (quantized here) or from a
        quantized checkpoint's parts once all have arrived; True when the rows are filled."""
        layer, start, rows = target
        needed = ("qweight", "scales", "offsets") if isinstance(layer, Int4Linear) else ("qweight", "scales")
        if parts is None:  # a full-precision weight
            if tensor.dim() != 2 or tensor.shape[0] != rows or not tensor.is_floating_point():
                raise ValueError(
                    f"tensor {name} has shape {tuple(tensor.shape)} and dtype {tensor.dtype}, "
                    f"expected a floating-point weight of {rows} rows"
                )
            if isinstance(layer, Int8Embedding):
                layer.set_weight(tensor)
            else:
                layer.quantize_rows(start, tensor)
            return True
        if not all(k in parts for k in needed):
            return False
        if set(parts) - set(needed):
            raise ValueError(
                f"{name}: unexpected quantized parts {sorted(set(parts) - set(needed))} for a {type(layer).__name__}"
            )
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
        if proj not in _FUSED or self.checkpoint_fused:
            return params[name]
        fused, shard = _FUSED[proj]
        whole = params[f"{parent}.{fused}.{leaf}"]
        sizes = self._fused_sizes(whole.shape[0], fused)
        return whole.narrow(0, sum(sizes[:shard]), sizes[shard])

    def _fused_sizes(self, rows: int, fused: str) -> list[int]:
        """Rows of each part of a fused projection: q|k|v, or gate|up (two halves, whichever MLP
        it belongs to: the dense one, an expert or a shared expert)."""
        return self._qkv_sizes if fused == "qkv_proj" else [rows // 2] * 2


# The dense families' classes (each family file names its own: pagedserve.engine.model.family).
class LlamaForCausalLM(CausalLM):
    """Llama / Mistral / Qwen2: pre-norm layers, SiLU gated MLP, plain RMSNorm."""


class Qwen3ForCausalLM(CausalLM):
    """Pre-norm layers with q/k norms (the spec's `qk_norm`)."""


class Gemma2ForCausalLM(CausalLM):
    layer_cls = SandwichDecoderLayer


class Gemma3ForCausalLM(CausalLM):
    layer_cls = SandwichDecoderLayer


class Phi3ForCausalLM(CausalLM):
    checkpoint_fused = True
