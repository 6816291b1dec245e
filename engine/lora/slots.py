"""The resident adapters: `max_loras` slots of stacked LoRA factors per layer, swapped LRU.

Per layer and per fused projection group (qkv, o, gate_up, down) the slots are two tensors:

    A  [max_loras * R_g, in]         slot s owns rows    [s * R_g, (s + 1) * R_g)
    B  [out_total, max_loras * R_g]  slot s owns columns [s * R_g, (s + 1) * R_g)

where `R_g = parts * max_lora_rank` (qkv has 3 parts, gate_up 2, the others 1). Part j of a
group (e.g. k_proj in qkv) fills A's rows `[j * R, j * R + r)` of its slot and the block of B
at (the part's output rows, those columns): B is block-diagonal per slot, so one shrink and one
expand cover a fused projection and each part lands on its own output slice. Unused rows and
columns stay zero, so a rank below `max_lora_rank` or an untargeted projection adds exactly 0.

The tensors are allocated on the first adapter load (an engine that never sees an adapter pays
nothing). `activate(adapters)` makes the step's adapters resident, evicting the least recently
used slots that the step does not need.
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass

import torch

from pagedserve.engine.lora.adapter import TARGETS, LoRAAdapter, LoRAShapes

GROUPS = ("qkv", "o", "gate_up", "down")


@dataclass(slots=True)
class GroupWeights:
    """One layer's stacked slots for one projection group."""

    a: torch.Tensor  # [max_loras * rank_per_slot, in]
    b: torch.Tensor  # [out_total, max_loras * rank_per_slot]
    rank_per_slot: int


def _group_layout(shapes: LoRAShapes) -> dict[str, tuple[int, list[int]]]:
    """group -> (in_features, output size of each part)."""
    h, i, q, kv = shapes.hidden_size, shapes.intermediate_size, shapes.q_size, shapes.kv_size
    return {"qkv": (h, [q, kv, kv]), "o": (q, [h]), "gate_up": (h, [i, i]), "down": (i, [h])}


class LoRASlots:
    """`max_loras` resident adapters of rank <= `max_lora_rank`, LRU-swapped."""

    def __init__(
        self, shapes: LoRAShapes, max_loras: int, max_lora_rank: int, dtype: torch.dtype, device: torch.device
    ) -> None:
        if max_loras < 1 or max_lora_rank < 1:
            raise ValueError(f"max_loras and max_lora_rank must be >= 1, got {max_loras}, {max_lora_rank}")
        self.shapes, self.max_loras, self.max_rank = shapes, max_loras, max_lora_rank
        self.dtype, self.device = dtype, device
        self.layout = _group_layout(shapes)
        self.layers: list[dict[str, GroupWeights]] | None = None  # allocated on first load
        self.resident: OrderedDict[str, int] = OrderedDict()  # adapter key -> slot, oldest first
        self.num_loads = 0  # adapters copied into a slot (swaps included)

    def _allocate(self) -> list[dict[str, GroupWeights]]:
        self.layers = []
        for _ in range(self.shapes.num_layers):
            groups = {}
            for group, (in_features, parts) in self.layout.items():
                r = len(parts) * self.max_rank
                groups[group] = GroupWeights(
                    torch.zeros(self.max_loras * r, in_features, dtype=self.dtype, device=self.device),
                    torch.zeros(sum(parts), self.max_loras * r, dtype=self.dtype, device=self.device),
                    r,
                )
            self.layers.append(groups)
        return self.layers

    def activate(self, adapters: list[LoRAAdapter]) -> dict[str, int]:
        """Make these adapters resident (each once); returns adapter key -> slot. Evicts the least
        recently used slots not needed now; ValueError if more adapters than slots are asked for."""
        wanted = list(dict.fromkeys(a.key for a in adapters))
        if len(wanted) > self.max_loras:
            raise ValueError(f"{len(wanted)} adapters in one step, but max_loras is {self.max_loras}")
        by_key = {a.key: a for a in adapters}
        for key in wanted:
            if key in self.resident:
                self.resident.move_to_end(key)
        for key in wanted:
            if key not in self.resident:
                self._load(by_key[key], self._free_slot(set(wanted)))
        return {key: self.resident[key] for key in wanted}

    def _free_slot(self, keep: set[str]) -> int:
        used = set(self.resident.values())
        for slot in range(self.max_loras):
            if slot not in used:
                return slot
        victim = next(k for k in self.resident if k not in keep)  # oldest first
        return self.resident.pop(victim)

    def _load(self, adapter: LoRAAdapter, slot: int) -> None:
        if adapter.rank > self.max_rank:
            raise ValueError(f"adapter {adapter.name!r} has rank {adapter.rank}, above max_lora_rank={self.max_rank}")
        layers = self.layers if self.layers is not None else self._allocate()
        for groups in layers:
            for g in groups.values():  # clear the slot: an untargeted projection must add 0
                g.a[slot * g.rank_per_slot : (slot + 1) * g.rank_per_slot].zero_()
                g.b[:, slot * g.rank_per_slot : (slot + 1) * g.rank_per_slot].zero_()
        r = adapter.rank
        for (layer, target), (a, b) in adapter.factors.items():
            group, part = TARGETS[target]
            g = layers[layer][group]
            sizes = self.layout[group][1]
            row = slot * g.rank_per_slot + part * self.max_rank
            out = sum(sizes[:part])
            g.a[row : row + r].copy_(a)
            g.b[out : out + sizes[part], row : row + r].copy_(b)
        self.resident[adapter.key] = slot
        self.num_loads += 1
