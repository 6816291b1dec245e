"""KV cache groups: layers that share one block table per request (the hybrid KV cache).

Layers are grouped by attention kind: full attention, or a sliding window of w tokens. Every
group has its own block table per request, and all groups draw their blocks from ONE block pool.

Physical layout (as vLLM's hybrid allocator): every group holds the same number of layers,
`num_tensors`. The KV memory is `num_tensors` tensors of `[2, num_blocks, block_size, kv_heads,
head_dim]`; the j-th layer of every group reads and writes tensor j. A block id is therefore one
page of `num_tensors` layers (keys and values), whichever group holds it, and a block freed by a
sliding group is memory a full-attention group can use. One block costs `num_tensors` layers'
bytes (`KVCacheLayout.bytes_per_block`), which is what the memory budget divides by.

Group size: the smallest number of layers of one kind, or the largest when it is within 1.25x of
the smallest (fewer, larger groups; some tensors then serve fewer groups than others and a few
pages stay idle). Gemma 3's 5:1 pattern with 18 layers: 15 sliding and 3 full, groups of 3: one
full group and five sliding ones. A model whose layers are all of one kind has one group of every
layer, `num_tensors == num_layers`: the layout before the hybrid cache.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass


@dataclass(frozen=True, slots=True)
class KVCacheGroupSpec:
    """A group's attention kind (`window` None: full attention) and its layers."""

    window: int | None
    layers: tuple[int, ...]


@dataclass(frozen=True, slots=True)
class KVCacheLayout:
    groups: tuple[KVCacheGroupSpec, ...]
    num_tensors: int  # shared KV tensors; a block id is one page in each of them
    num_layers: int

    @property
    def is_hybrid(self) -> bool:
        """More than one group, or a group whose window lets it return blocks."""
        return len(self.groups) > 1 or self.groups[0].window is not None

    def group_of_layer(self) -> list[int]:
        out = [0] * self.num_layers
        for g, group in enumerate(self.groups):
            for layer in group.layers:
                out[layer] = g
        return out

    def tensor_of_layer(self) -> list[int]:
        """The shared tensor each layer reads and writes (its index within its group)."""
        out = [0] * self.num_layers
        for group in self.groups:
            for j, layer in enumerate(group.layers):
                out[layer] = j
        return out

    def blocks_for_one_sequence(self, num_tokens: int, block_size: int, chunk: int) -> int:
        """Blocks one sequence of `num_tokens` holds at most, computed in chunks of at most
        `chunk` tokens: every block in a full group; in a sliding group the blocks of its window
        before the chunk plus the chunk's own."""
        total = 0
        full = -(-num_tokens // block_size)
        for group in self.groups:
            if group.window is None:
                total += full
            else:
                total += min(full, -(-(group.window - 1 + chunk) // block_size) + 1)
        return total

    def longest_sequence(self, num_blocks: int, block_size: int, chunk: int, limit: int) -> int:
        """The most tokens (at most `limit`) one sequence can hold in a pool of `num_blocks`."""
        lo, hi = 0, limit
        while lo < hi:
            mid = (lo + hi + 1) // 2
            if self.blocks_for_one_sequence(mid, block_size, chunk) <= num_blocks:
                lo = mid
            else:
                hi = mid - 1
        return lo


def plan_layout(windows: Sequence[int | None], hybrid: bool = True) -> KVCacheLayout:
    """The groups of a model whose layer i has sliding window `windows[i]` (None: full).

    `hybrid` False: one group of every layer that keeps every block (full-attention bookkeeping;
    sliding layers still attend only to their window), the layout before the hybrid cache."""
    num_layers = len(windows)
    if num_layers < 1:
        raise ValueError("a model needs at least one layer")
    kinds: dict[int | None, list[int]] = {}
    for layer, window in enumerate(windows):
        kinds.setdefault(window, []).append(layer)
    if not hybrid or len(kinds) == 1:
        window = next(iter(kinds)) if hybrid else None
        return KVCacheLayout((KVCacheGroupSpec(window, tuple(range(num_layers))),), num_layers, num_layers)
    smallest = min(len(layers) for layers in kinds.values())
    largest = max(len(layers) for layers in kinds.values())
    size = largest if largest < 1.25 * smallest else smallest
    groups: list[KVCacheGroupSpec] = []
    # Full attention first: group 0 is then a full group (the KV offload tier and the draft
    # model's comparisons read group 0), then windows from the widest.
    for window in sorted(kinds, key=lambda w: (w is not None, -(w or 0))):
        layers = kinds[window]
        groups.extend(KVCacheGroupSpec(window, tuple(layers[i : i + size])) for i in range(0, len(layers), size))
    return KVCacheLayout(tuple(groups), size, num_layers)
