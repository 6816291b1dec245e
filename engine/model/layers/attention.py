"""Self-attention over the paged KV cache, shared by every family.

q/k/v are one fused linear (`qkv_proj`, rows q|k|v). What families change is read from the
spec: biases, q/k RMSNorms before RoPE (per head: Qwen3, Gemma 3; whole projections: OLMoE), the score scale (Gemma's
`query_pre_attn_scalar`), soft-capping of the scores (Gemma 2), and this layer's sliding window
and RoPE table.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import nn

from pagedserve.engine.attention.backend import AttentionBackend
from pagedserve.engine.attention.compiled_op import AttentionStep
from pagedserve.engine.attention.metadata import AttentionMetadata
from pagedserve.engine.lora.punica import LoRALayer
from pagedserve.engine.model.layers.norm import eager_ops, make_norm
from pagedserve.engine.model.layers.rotary import apply_rope, table_of
from pagedserve.engine.model.spec import ModelSpec
from pagedserve.kernels.cpu_fused_ops import CpuFusedOps


class Attention(nn.Module):
    def __init__(
        self,
        spec: ModelSpec,
        layer: int,
        dtype: torch.dtype,
        backend: AttentionBackend,
        ops: CpuFusedOps | None = None,
    ) -> None:
        super().__init__()
        self.num_heads, self.num_kv_heads, self.head_dim = spec.num_heads, spec.num_kv_heads, spec.head_dim
        q_size, kv_size = spec.num_heads * spec.head_dim, spec.num_kv_heads * spec.head_dim
        self.qkv_proj = nn.Linear(spec.hidden_size, q_size + 2 * kv_size, bias=spec.qkv_bias, dtype=dtype)
        self.o_proj = nn.Linear(q_size, spec.hidden_size, bias=spec.o_bias, dtype=dtype)
        # Per head (Qwen3, Gemma 3), or over the whole q and k projections (`qk_norm_full`, OLMoE).
        self.qk_norm_full = spec.qk_norm_full
        q_norm_size, k_norm_size = (q_size, kv_size) if spec.qk_norm_full else (spec.head_dim, spec.head_dim)
        self.q_norm = make_norm(spec, q_norm_size, dtype) if spec.qk_norm else None
        self.k_norm = make_norm(spec, k_norm_size, dtype) if spec.qk_norm else None
        self.scale = spec.scale
        self.window = spec.window_of(layer)
        self.softcap = spec.attn_softcap
        self.rope_table = table_of(spec, layer)
        self.backend = backend
        self.ops = ops
        # Tensor parallelism (pagedserve.engine.model.layers.parallel): sums the ranks' partial o_proj outputs.
        self.reduce: Callable[[torch.Tensor], torch.Tensor] | None = None

    def forward(
        self,
        h: torch.Tensor,
        rope: dict[str, tuple[torch.Tensor, torch.Tensor]],
        kv_cache: torch.Tensor,
        meta: AttentionMetadata | AttentionStep,
        lora: LoRALayer | None = None,
    ) -> torch.Tensor:
        num_tokens = h.shape[0]
        qkv = self.qkv_proj(h)
        if lora is not None:
            lora.add("qkv", h, qkv)
        cos, sin = rope[self.rope_table]
        qk_heads = self.num_heads + self.num_kv_heads
        qk = qkv[:, : qk_heads * self.head_dim].view(num_tokens, qk_heads, self.head_dim)
        if self.q_norm is not None and self.k_norm is not None and self.qk_norm_full:
            q, k = qk[:, : self.num_heads].reshape(num_tokens, -1), qk[:, self.num_heads :].reshape(num_tokens, -1)
            qk = torch.cat((self.q_norm(q), self.k_norm(k)), dim=1).view(num_tokens, qk_heads, self.head_dim)
        elif self.q_norm is not None and self.k_norm is not None:
            qk = torch.cat((self.q_norm(qk[:, : self.num_heads]), self.k_norm(qk[:, self.num_heads :])), dim=1)
        # RoPE on q and k together: one pass over [T, heads + kv_heads, head_dim].
        ops = eager_ops(self.ops)
        qk = ops.rotary_embedding_(qk, cos, sin) if ops else apply_rope(qk, cos, sin)
        q, k = qk[:, : self.num_heads], qk[:, self.num_heads :]
        v = qkv[:, qk_heads * self.head_dim :].view(num_tokens, self.num_kv_heads, self.head_dim)
        if isinstance(
            meta, AttentionStep
        ):  # a compiled forward: one opaque op (pagedserve.engine.attention.compiled_op)
            out = torch.ops.pagedserve.paged_attention(q, k, v, kv_cache, meta, self.scale)
        else:
            out = self.backend.forward(q, k, v, kv_cache, meta, self.scale, window=self.window, softcap=self.softcap)
        out = out.reshape(num_tokens, -1)
        out = self.o_proj(out) if lora is None else lora.add("o", out, self.o_proj(out))
        return out if self.reduce is None else self.reduce(out)
