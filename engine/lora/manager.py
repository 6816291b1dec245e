"""A worker's adapters: loaded from their folders on first use (kept in memory, LRU-capped) and
made resident in the slots for each step that needs them."""

from __future__ import annotations

from collections import OrderedDict

import torch

from pagedserve.engine.lora.adapter import LoRAAdapter, LoRAShapes, load_adapter
from pagedserve.engine.lora.punica import LoRABatch
from pagedserve.engine.lora.request import LoRARequest
from pagedserve.engine.lora.slots import LoRASlots


class LoRAManager:
    """Adapters by (name, folder) in CPU memory (at most `max_cpu_loras`, least recently used
    dropped first: a dropped one is read again from its folder when next asked for), and the
    `max_loras` resident slots the model reads."""

    def __init__(
        self,
        shapes: LoRAShapes,
        max_loras: int,
        max_lora_rank: int,
        dtype: torch.dtype,
        device: torch.device,
        max_cpu_loras: int = 64,
    ) -> None:
        self.shapes, self.max_rank, self.dtype, self.device = shapes, max_lora_rank, dtype, device
        self.max_cpu_loras = max(max_cpu_loras, max_loras)
        self.slots = LoRASlots(shapes, max_loras, max_lora_rank, dtype, device)
        self.loaded: OrderedDict[tuple[str, str], LoRAAdapter] = OrderedDict()

    def load(self, ref: LoRARequest) -> LoRAAdapter:
        """The adapter `ref` names, read from its folder unless already in memory; ValueError
        (naming the problem) for a folder that is missing, malformed or does not fit the model."""
        key = (ref.name, ref.path)
        adapter = self.loaded.get(key)
        if adapter is None:
            adapter = load_adapter(ref.name, ref.path, self.shapes, self.max_rank)
            self.loaded[key] = adapter
            while len(self.loaded) > self.max_cpu_loras:
                self.loaded.popitem(last=False)
        self.loaded.move_to_end(key)
        return adapter

    def build_batch(
        self, adapters: list[LoRAAdapter | None], num_rows: list[int], use_triton: bool | None = None
    ) -> LoRABatch | None:
        """The step's LoRABatch for requests in row order (`num_rows[i]` token rows of request i,
        which uses `adapters[i]`, None for the base model); None when no request uses one."""
        used = [a for a in adapters if a is not None]
        if not used:
            return None
        slot_of = self.slots.activate(used)
        row_slots: list[int] = []
        for adapter, n in zip(adapters, num_rows):
            row_slots.extend([-1 if adapter is None else slot_of[adapter.key]] * n)
        assert self.slots.layers is not None  # activate() loaded at least one adapter
        return LoRABatch.build(self.slots.layers, row_slots, self.dtype, self.device, use_triton)


class LoRAUnsupported:
    """Stands for the runner's LoRA manager where adapters cannot run (a tensor-parallel worker,
    a mixture-of-experts model): every adapter is refused with `reason`."""

    def __init__(self, reason: str) -> None:
        self.reason = reason

    def load(self, ref: LoRARequest):
        raise ValueError(self.reason)

    def build_batch(self, adapters: list, num_rows: list[int], use_triton: bool | None = None) -> None:
        return None  # no request ever holds an adapter here
