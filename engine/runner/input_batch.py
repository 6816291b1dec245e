"""The persistent input batch: the running requests' tokens and block tables in preallocated
arrays, updated in place from the scheduler's diffs (vLLM V1's InputBatch idea).

Each running request owns one row: its known token ids (`token_ids[row, :num_tokens]`), how many
of them have KV in the cache (`num_computed_tokens`) and one block table per KV cache group
(`block_table[group, row, :num_blocks[group, row]]`; one group unless the model has a hybrid KV
cache, pagedserve.engine.kv_cache.groups). A block a sliding group dropped (id -1) is stored as 0:
its positions are outside the window, never read unmasked nor written. Rows are dense: removing a request moves the last row into
its place, so rows `[0, num_reqs)` are always the live ones, in no meaningful order.

A step's flattened inputs (token ids, positions, slot mapping, query start offsets, sequence
lengths, block tables) are computed with numpy from these arrays, without a Python loop over
tokens, into per-step buffers. There are two sets of per-step buffers, used in turn: a step's
tensors stay valid while the next step is prepared (async scheduling prepares step k+1 while
step k runs), and are overwritten only when the step after that is prepared.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import torch


def cdiv(a: int, b: int) -> int:
    return -(-a // b)


@dataclass(slots=True)
class StepInputs:
    """One step's flattened batch: sequences in `req_ids` order, each one's query rows after
    the previous one's. Arrays are views of the batch's per-step buffers (see the module doc)."""

    req_ids: list[str]
    rows: np.ndarray  # [num_seqs] the batch row of each sequence
    query_lens: np.ndarray  # [num_seqs]
    query_start_loc: np.ndarray  # [num_seqs + 1] int32
    seq_lens: np.ndarray  # [num_seqs] int32
    positions: np.ndarray  # [num_tokens] int64
    slot_mapping: tuple[np.ndarray, ...]  # per KV cache group: [num_tokens] int64
    block_tables: tuple[np.ndarray, ...]  # per KV cache group: [num_seqs, max_blocks] int32, padded with 0
    input_ids: np.ndarray  # [num_tokens] int64; filled by InputBatch.gather_input_ids
    token_index: np.ndarray  # [num_tokens] flat index of each input token in InputBatch.token_ids

    @property
    def num_tokens(self) -> int:
        return len(self.positions)


class _StepBuffers:
    def __init__(self, max_num_tokens: int, max_num_reqs: int, num_groups: int) -> None:
        self.input_ids = np.zeros(max_num_tokens, dtype=np.int64)
        self.positions = np.zeros(max_num_tokens, dtype=np.int64)
        self.slot_mapping = np.zeros((num_groups, max_num_tokens), dtype=np.int64)
        self.token_index = np.zeros(max_num_tokens, dtype=np.int64)
        self.query_start_loc = np.zeros(max_num_reqs + 1, dtype=np.int32)
        self.seq_lens = np.zeros(max_num_reqs, dtype=np.int32)


class InputBatch:
    """Rows of the running requests; see the module doc."""

    def __init__(
        self, max_num_reqs: int, max_model_len: int, max_num_tokens: int, block_size: int, num_groups: int = 1
    ) -> None:
        if min(max_num_reqs, max_model_len, max_num_tokens, block_size) < 1:
            raise ValueError("InputBatch sizes must be positive")
        self.max_num_reqs = max_num_reqs
        self.max_model_len = max_model_len
        self.max_num_tokens = max_num_tokens
        self.block_size = block_size
        self.max_blocks_per_req = cdiv(max_model_len, block_size)
        self.token_ids = np.zeros((max_num_reqs, max_model_len), dtype=np.int64)
        self.num_tokens = np.zeros(max_num_reqs, dtype=np.int64)
        self.num_computed_tokens = np.zeros(max_num_reqs, dtype=np.int64)
        self.num_groups = num_groups
        self.block_table = np.zeros((num_groups, max_num_reqs, self.max_blocks_per_req), dtype=np.int32)
        self.num_blocks = np.zeros((num_groups, max_num_reqs), dtype=np.int64)
        self.req_ids: list[str] = []  # row -> request id, rows [0, num_reqs)
        self.req_index: dict[str, int] = {}  # request id -> row
        self._buffers = (
            _StepBuffers(max_num_tokens, max_num_reqs, num_groups),
            _StepBuffers(max_num_tokens, max_num_reqs, num_groups),
        )
        self._turn = 0

    @property
    def num_reqs(self) -> int:
        return len(self.req_ids)

    # -- rows ------------------------------------------------------------------------------
    def add_request(
        self, req_id: str, token_ids: list[int], num_computed_tokens: int, block_ids: Sequence[Sequence[int]]
    ) -> int:
        """A new row for `req_id` (new, or resumed after a preemption); returns the row."""
        if req_id in self.req_index:
            raise ValueError(f"request {req_id!r} already has a row")
        if self.num_reqs == self.max_num_reqs:
            raise RuntimeError(f"the input batch is full ({self.max_num_reqs} requests)")
        if len(token_ids) > self.max_model_len:
            raise ValueError(f"{req_id}: {len(token_ids)} tokens exceed max_model_len {self.max_model_len}")
        row = self.num_reqs
        self.req_ids.append(req_id)
        self.req_index[req_id] = row
        self.token_ids[row, : len(token_ids)] = token_ids
        self.num_tokens[row] = len(token_ids)
        self.num_computed_tokens[row] = num_computed_tokens
        self.num_blocks[:, row] = 0
        self.append_blocks(row, block_ids)
        return row

    def remove_request(self, req_id: str) -> None:
        """Drop `req_id`'s row (no-op if it has none); the last row moves into its place."""
        row = self.req_index.pop(req_id, None)
        if row is None:
            return
        last = self.num_reqs - 1
        moved = self.req_ids.pop()
        if row != last:
            n = int(self.num_tokens[last])
            self.token_ids[row, :n] = self.token_ids[last, :n]
            for g in range(self.num_groups):
                b = int(self.num_blocks[g, last])
                self.block_table[g, row, :b] = self.block_table[g, last, :b]
                self.num_blocks[g, row] = b
            self.num_tokens[row] = n
            self.num_computed_tokens[row] = self.num_computed_tokens[last]
            self.req_ids[row] = moved
            self.req_index[moved] = row

    def append_blocks(self, row: int, block_ids: Sequence[Sequence[int]]) -> None:
        """New blocks at the end of the row's table of each group (`block_ids[g]`)."""
        if len(block_ids) != self.num_groups:
            raise ValueError(f"expected block ids for {self.num_groups} KV cache groups, got {len(block_ids)}")
        for g, ids in enumerate(block_ids):
            start = int(self.num_blocks[g, row])
            end = start + len(ids)
            if end > self.max_blocks_per_req:
                raise ValueError(f"{self.req_ids[row]}: {end} blocks exceed {self.max_blocks_per_req} per request")
            self.block_table[g, row, start:end] = np.maximum(np.asarray(ids, dtype=np.int64), 0)
            self.num_blocks[g, row] = end

    def append_tokens(self, row: int, token_ids: list[int]) -> None:
        """Known tokens after the row's last one (sampled, or kept drafts)."""
        start = int(self.num_tokens[row])
        end = min(start + len(token_ids), self.max_model_len)  # past max_model_len: it has ended
        self.token_ids[row, start:end] = token_ids[: end - start]
        self.num_tokens[row] = end

    def write_scratch(self, row: int, token_ids: list[int]) -> None:
        """Tokens after the row's known ones that are computed but not (yet) known to be kept:
        speculative drafts. They do not count in `num_tokens`."""
        start = int(self.num_tokens[row])
        self.token_ids[row, start : start + len(token_ids)] = token_ids

    # -- one step --------------------------------------------------------------------------
    def prepare(self, req_ids: list[str], num_scheduled: np.ndarray) -> StepInputs:
        """The step's flattened batch for `req_ids` in that order, `num_scheduled[i]` tokens
        each from the request's computed ones on (`num_computed_tokens`, which the caller sets
        from the scheduler's output first).
        `input_ids` is left to `gather_input_ids` (async scheduling fills the tokens sampled by
        the step still running first)."""
        rows = np.fromiter((self.req_index[r] for r in req_ids), dtype=np.int64, count=len(req_ids))
        num_scheduled = np.asarray(num_scheduled, dtype=np.int64)
        num_seqs = len(rows)
        buf = self._buffers[self._turn]
        self._turn ^= 1
        cu = np.cumsum(num_scheduled)
        total = int(cu[-1])
        if total > self.max_num_tokens:
            raise ValueError(f"{total} tokens scheduled; the batch holds {self.max_num_tokens}")
        starts = self.num_computed_tokens[rows]
        seq_lens = starts + num_scheduled
        if int(seq_lens.max()) > self.max_model_len:
            raise ValueError("a request is scheduled past max_model_len")
        # Position of every query token: its sequence's start plus its offset in the sequence.
        seq_of_token = np.repeat(np.arange(num_seqs), num_scheduled)
        offsets = np.arange(total) - np.repeat(cu - num_scheduled, num_scheduled)
        positions = buf.positions[:total]
        np.add(starts[seq_of_token], offsets, out=positions)
        token_rows = rows[seq_of_token]
        token_index = buf.token_index[:total]
        np.add(token_rows * self.max_model_len, positions, out=token_index)
        bs = self.block_size
        slot_mapping, block_tables = [], []
        for g in range(self.num_groups):
            slots = buf.slot_mapping[g, :total]
            table = self.block_table[g]
            np.add(table[token_rows, positions // bs].astype(np.int64) * bs, positions % bs, out=slots)
            slot_mapping.append(slots)
            num_blocks = self.num_blocks[g, rows]
            max_blocks = int(num_blocks.max())
            tables = table[rows, :max_blocks]
            tables[np.arange(max_blocks)[None, :] >= num_blocks[:, None]] = 0  # stale ids of old rows
            block_tables.append(tables)
        query_start = buf.query_start_loc[: num_seqs + 1]
        query_start[0] = 0
        query_start[1:] = cu
        seq_lens_out = buf.seq_lens[:num_seqs]
        seq_lens_out[:] = seq_lens
        return StepInputs(
            req_ids=list(req_ids),
            rows=rows,
            query_lens=num_scheduled,
            query_start_loc=query_start,
            seq_lens=seq_lens_out,
            positions=positions,
            slot_mapping=tuple(slot_mapping),
            block_tables=tuple(block_tables),
            input_ids=buf.input_ids[:total],
            token_index=token_index,
        )

    def gather_input_ids(self, step: StepInputs) -> torch.Tensor:
        """Fill `step.input_ids` from the token array (call once every token it reads is known)
        and return it as a tensor (sharing the buffer's memory)."""
        np.take(self.token_ids.reshape(-1), step.token_index, out=step.input_ids)
        return torch.from_numpy(step.input_ids)
