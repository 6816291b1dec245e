"""Paged attention through the Triton kernel (pagedserve.kernels.triton_paged_attention): the GPU path.

After the base class has written the step's keys/values into the cache, one kernel launch
attends every query token of the step (decodes, prefill chunks and whole prompts alike), reading
every key/value from the cache (de-quantized in the kernel when the cache is quantized). On a
CPU it runs only in Triton's interpreter, for tests.
"""

from __future__ import annotations

import torch

from pagedserve.engine.attention.backend import AttentionBackend
from pagedserve.engine.attention.metadata import AttentionMetadata
from pagedserve.kernels.triton_paged_attention import paged_attention


class TritonAttentionBackend(AttentionBackend):
    name = "triton"
    supports_windows = False  # sliding / soft-capped layers get the torch backend (selector.backend_for_layer)

    def attend(
        self,
        query: torch.Tensor,
        key: torch.Tensor,
        value: torch.Tensor,
        kv_cache: torch.Tensor,
        meta: AttentionMetadata,
        scale: float,
        window: int | None = None,
        softcap: float | None = None,
    ) -> torch.Tensor:
        if softcap is not None or (window is not None and meta.max_seq_len > window):
            raise NotImplementedError(
                "the triton attention backend has no sliding window or soft-capping; "
                "use attention_backend: torch for this model"
            )
        return paged_attention(
            query,
            kv_cache[0],
            kv_cache[1],
            meta.block_tables,
            meta.seq_lens_tensor,
            meta.query_start_loc,
            meta.max_query_len,
            scale,
            kv_quant=self.kv_dtype.value,
        )
