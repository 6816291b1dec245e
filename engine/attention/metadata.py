"""What an attention backend is told about one flattened batch.

A step runs `num_tokens` query tokens that belong to `num_seqs` sequences, laid out one sequence
after another (sequence i owns query rows `query_start_loc[i]:query_start_loc[i+1]`). Each
sequence's new tokens are the *last* `query_len` positions of its context of `seq_len` tokens:
the first `seq_len - query_len` tokens are already in the paged KV cache.

KV cache layout, one tensor per layer: `[2, num_blocks, block_size, num_kv_heads, head_dim]`
(index 0 = keys, 1 = values). Token t of a sequence lives in block `block_tables[i, t // block_size]`
at offset `t % block_size`; its flat slot is `block_id * block_size + offset`.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(slots=True)
class AttentionMetadata:
    num_seqs: int
    num_tokens: int
    # Host-side copies, for cheap Python loops in the CPU backend.
    query_lens: list[int]
    seq_lens: list[int]
    # Device tensors.
    query_start_loc: torch.Tensor  # [num_seqs + 1] int32, cumulative query lengths
    seq_lens_tensor: torch.Tensor  # [num_seqs] int32
    block_tables: torch.Tensor  # [num_seqs, max_blocks_per_seq] int32, padded with 0
    slot_mapping: torch.Tensor  # [num_tokens] int64, where each new token's K/V is written
    max_query_len: int
    max_seq_len: int
    # Number of leading sequences whose query_len == 1 (decodes). The runner orders decodes
    # first so a backend can treat rows [0, num_decodes) as one batched decode.
    num_decodes: int

    def __post_init__(self) -> None:
        if len(self.query_lens) != self.num_seqs or len(self.seq_lens) != self.num_seqs:
            raise ValueError("query_lens and seq_lens must have one entry per sequence")
        if sum(self.query_lens) != self.num_tokens:
            raise ValueError("query_lens must add up to num_tokens")
        if any(q > s for q, s in zip(self.query_lens, self.seq_lens)):
            raise ValueError("a sequence's query_len cannot exceed its seq_len")
        if any(q != 1 for q in self.query_lens[: self.num_decodes]):
            raise ValueError("the first num_decodes sequences must have query_len == 1")
