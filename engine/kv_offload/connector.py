"""The copy between the engine's paged KV cache and LMCache's chunk buffers.

Engine layout, one tensor per layer: `[2, num_blocks, block_size, kv_heads, head_dim]`.
LMCache chunk layout (KV_2LTD): `[2, num_layers, tokens, kv_heads * head_dim]`, in CPU memory.
Chunks always start and end on block boundaries (chunk_size is a multiple of block_size), so a
chunk is a list of whole blocks and each copy is one `index_select` / `index_copy_` per layer on
the engine's device (CPU or CUDA: the same code), plus one host<->device transfer per chunk.

Imports LMCache: import this module only when offload is on.
"""

from __future__ import annotations

import torch
from lmcache.v1.gpu_connector.gpu_connectors import GPUConnectorInterface


class PagedKVConnector(GPUConnectorInterface):
    """LMCache calls `batched_from_gpu` (store) and `batched_to_gpu` (retrieve) with the keyword
    arguments the engine passed to `store` / `retrieve`:

    - `block_ids`: int64 tensor on the engine's device, the request's block table;
    - `load_start`, `load_end` (retrieve only): token range to write. Parts of a chunk outside it
      are left alone: blocks before `load_start` are the engine's own prefix-cache hits (maybe
      shared with other requests), blocks after `load_end` are computed by the model.
    """

    def __init__(self, kv_caches: list[torch.Tensor], block_size: int) -> None:
        self.kv_caches = kv_caches
        self.block_size = block_size
        _, _, bs, heads, head_dim = kv_caches[0].shape
        if bs != block_size:
            raise ValueError(f"KV cache block size {bs} != {block_size}")
        self.num_layers = len(kv_caches)
        self.hidden = heads * head_dim
        self.device = kv_caches[0].device

    # -- LMCache interface -----------------------------------------------------------------
    def get_shape(self, num_tokens: int) -> torch.Size:
        return torch.Size([2, self.num_layers, num_tokens, self.hidden])

    def batched_from_gpu(self, memory_objs, starts, ends, **kwargs) -> None:
        block_ids: torch.Tensor = kwargs["block_ids"]
        for memory_obj, start, end in zip(memory_objs, starts, ends):
            ids = self._block_range(block_ids, start, end)
            # Gather on the engine's device, then one transfer into the chunk buffer.
            staged = torch.stack([kv.index_select(1, ids) for kv in self.kv_caches], dim=1)
            dest = memory_obj.tensor
            dest.view(staged.shape).copy_(staged)

    def batched_to_gpu(self, memory_objs=None, starts=None, ends=None, **kwargs) -> None:
        block_ids: torch.Tensor = kwargs["block_ids"]
        load_start: int = kwargs["load_start"]
        load_end: int = kwargs["load_end"]
        bs = self.block_size
        for memory_obj, start, end in zip(memory_objs, starts, ends):
            lo, hi = max(start, load_start), min(end, load_end)
            if lo >= hi:
                continue
            ids = self._block_range(block_ids, lo, hi)
            src = memory_obj.tensor[:, :, lo - start : hi - start]
            src = src.to(self.device, non_blocking=False)
            src = src.reshape(2, self.num_layers, (hi - lo) // bs, bs, -1, self.kv_caches[0].shape[-1])
            for layer, kv in enumerate(self.kv_caches):
                kv.index_copy_(1, ids, src[:, layer])

    def to_gpu(self, memory_obj, start: int, end: int, **kwargs) -> None:
        self.batched_to_gpu([memory_obj], [start], [end], **kwargs)

    def from_gpu(self, memory_obj, start: int, end: int, **kwargs) -> None:
        self.batched_from_gpu([memory_obj], [start], [end], **kwargs)

    # -- helpers ---------------------------------------------------------------------------
    def _block_range(self, block_ids: torch.Tensor, start: int, end: int) -> torch.Tensor:
        bs = self.block_size
        if start % bs or end % bs:
            raise ValueError(f"token range [{start}, {end}) is not block-aligned (block_size {bs})")
        if end // bs > block_ids.numel():
            raise ValueError(f"token range [{start}, {end}) exceeds the {block_ids.numel()} blocks given")
        return block_ids[start // bs : end // bs]
