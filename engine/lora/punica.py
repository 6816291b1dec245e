"""One step's LoRA: every token row with its adapter slot, applied to a projection's output.

For a fused projection group with slots stacked as in pagedserve.engine.lora.slots (A `[S*R, in]`, B
`[out, S*R]`, block-diagonal per slot), a row t whose request uses slot s gains

    out[t] += (x[t] @ A_s.T) @ B_s.T

On CPU (torch) this is two dense matmuls over the slots in use and a mask: shrink every row
against every used slot (`x @ A[:n*R].T`, `[T, n*R]`), zero the columns of the slots a row does
not use, expand (`addmm` into `out`). No per-adapter loop, no data-dependent shapes; the extra
shrink work is `n*R` columns, small next to the projection itself. Rows of the base model
(slot -1) gain exactly 0. On CUDA the same product runs as the Triton BGMV kernels
(pagedserve.kernels.triton_lora), which read only each row's own slot.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from pagedserve.engine.lora.slots import GroupWeights


@dataclass(slots=True)
class LoRALayer:
    """The step's LoRA for one decoder layer: `add(group, x, out)` adds each row's delta to `out`."""

    groups: dict[str, GroupWeights]
    batch: LoRABatch

    def add(self, group: str, x: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
        g = self.groups[group]
        b = self.batch
        r = g.rank_per_slot
        if b.use_triton:
            from pagedserve.kernels.triton_lora import bgmv_expand, bgmv_shrink

            y = bgmv_shrink(x.contiguous(), g.a, b.slot_index, r)
            return bgmv_expand(y, g.b, b.slot_index, out)
        if b.mask is None:  # every row uses slot `first`: that slot's columns only
            cols = slice(b.first * r, (b.first + 1) * r)
            return out.addmm_(torch.mm(x, g.a[cols].t()), g.b[:, cols].t())
        n = b.num_slots  # rows keep only their own slot's columns (base rows: none)
        xa = (torch.mm(x, g.a[: n * r].t()).view(-1, n, r) * b.mask).view(-1, n * r)
        return out.addmm_(xa, g.b[:, : n * r].t())


@dataclass(slots=True)
class LoRABatch:
    """`slot_index [T]`: each token row's slot (-1: the base model). Built by the model runner."""

    layers: list[dict[str, GroupWeights]]
    slot_index: torch.Tensor  # int32 [T]
    num_slots: int  # slots [0, num_slots) cover every index used
    first: int  # the slot of row 0
    mask: torch.Tensor | None  # [T, num_slots, 1] one-hot in the model dtype; None when one slot has every row
    use_triton: bool

    @classmethod
    def build(
        cls,
        layers: list[dict[str, GroupWeights]],
        row_slots: list[int],
        dtype: torch.dtype,
        device: torch.device,
        use_triton: bool | None = None,
    ) -> LoRABatch:
        """`row_slots`: one slot per token row (-1: no adapter). `use_triton` defaults to CUDA."""
        index = torch.tensor(row_slots, dtype=torch.int32, device=device)
        num_slots = max(row_slots) + 1
        if use_triton is None:
            use_triton = device.type == "cuda"
        mask = None
        if not use_triton and (min(row_slots) < 0 or len(set(row_slots)) > 1):
            mask = torch.zeros(len(row_slots), num_slots, 1, dtype=dtype, device=device)
            rows = index >= 0
            mask[rows.nonzero().squeeze(1), index[rows].long(), 0] = 1
        return cls(layers, index, num_slots, row_slots[0], mask, use_triton)

    def layer(self, i: int) -> LoRALayer:
        return LoRALayer(self.layers[i], self)
