"""The persistent input batch's bookkeeping: exact row contents after add / remove (compaction) /
block and token appends, and the flattened step inputs it computes."""

from __future__ import annotations

import numpy as np
import pytest

from pagedserve.engine.runner.input_batch import InputBatch

BS = 4


def make_batch(max_reqs: int = 4, max_len: int = 16, max_tokens: int = 32) -> InputBatch:
    return InputBatch(max_reqs, max_len, max_tokens, BS)


def row_of(batch: InputBatch, req_id: str) -> tuple[list[int], list[int], int]:
    row = batch.req_index[req_id]
    n, b = int(batch.num_tokens[row]), int(batch.num_blocks[0, row])
    return (
        batch.token_ids[row, :n].tolist(),
        batch.block_table[0, row, :b].tolist(),
        int(batch.num_computed_tokens[row]),
    )


def test_add_fills_rows_in_order():
    batch = make_batch()
    assert batch.add_request("a", [1, 2, 3], 0, ([7],)) == 0
    assert batch.add_request("b", [4, 5, 6, 7, 8], 4, ([2, 9],)) == 1
    assert batch.req_ids == ["a", "b"] and batch.req_index == {"a": 0, "b": 1}
    assert row_of(batch, "a") == ([1, 2, 3], [7], 0)
    assert row_of(batch, "b") == ([4, 5, 6, 7, 8], [2, 9], 4)


def test_remove_moves_the_last_row_into_the_hole():
    batch = make_batch()
    for i, name in enumerate("abcd"):
        batch.add_request(name, [10 * i + j for j in range(i + 1)], i, ([i, 20 + i],))
    batch.remove_request("b")
    assert batch.req_ids == ["a", "d", "c"]
    assert batch.req_index == {"a": 0, "d": 1, "c": 2}
    assert row_of(batch, "d") == ([30, 31, 32, 33], [3, 23], 3)
    assert row_of(batch, "c") == ([20, 21, 22], [2, 22], 2)
    batch.remove_request("c")  # the last row: nothing moves
    batch.remove_request("missing")  # unknown ids are ignored
    assert batch.req_ids == ["a", "d"] and batch.num_reqs == 2
    batch.add_request("e", [5], 0, ([11],))  # takes the freed row 2
    assert batch.req_index["e"] == 2 and row_of(batch, "e") == ([5], [11], 0)


def test_a_moved_row_keeps_only_its_own_blocks_and_tokens():
    batch = make_batch()
    batch.add_request("long", list(range(12)), 0, ([1, 2, 3],))
    batch.add_request("short", [9], 0, ([4],))
    batch.remove_request("long")
    assert row_of(batch, "short") == ([9], [4], 0)
    batch.append_blocks(0, ([5],))
    assert row_of(batch, "short") == ([9], [4, 5], 0)


def test_append_tokens_blocks_and_scratch():
    batch = make_batch(max_len=12)
    batch.add_request("a", [1, 2], 0, ([3],))
    batch.append_tokens(0, [5])
    batch.append_blocks(0, ([6, 7],))
    batch.write_scratch(0, [40, 41])  # drafts: written after the known tokens, not counted
    assert row_of(batch, "a") == ([1, 2, 5], [3, 6, 7], 0)
    assert batch.token_ids[0, 3:5].tolist() == [40, 41]
    batch.append_tokens(0, list(range(8, 20)))  # capped at max_model_len
    assert int(batch.num_tokens[0]) == 12 and batch.token_ids[0, 11] == 16


def test_limits_are_refused():
    batch = make_batch(max_reqs=1, max_len=8)
    batch.add_request("a", [1], 0, ([0],))
    with pytest.raises(ValueError, match="already has a row"):
        batch.add_request("a", [1], 0, ([0],))
    with pytest.raises(RuntimeError, match="full"):
        batch.add_request("b", [1], 0, ([0],))
    with pytest.raises(ValueError, match="blocks exceed"):
        batch.append_blocks(0, ([1, 2],))  # 8 tokens / 4 = 2 blocks per request at most


def test_prepare_flattens_a_decode_and_a_prefill_chunk():
    batch = make_batch()
    batch.add_request("p", [11, 12, 13, 14, 15, 16], 0, ([5, 8],))  # prompt of 6, none computed
    batch.add_request("d", [21, 22, 23, 24, 25], 4, ([3, 6],))  # 4 computed: decodes position 4
    batch.num_computed_tokens[batch.req_index["p"]] = 2  # a chunk from position 2 on
    step = batch.prepare(["d", "p"], np.array([1, 3]))
    assert step.rows.tolist() == [1, 0]
    assert step.positions.tolist() == [4, 2, 3, 4]
    # slot = block_table[pos // 4] * 4 + pos % 4
    assert step.slot_mapping[0].tolist() == [6 * 4 + 0, 5 * 4 + 2, 5 * 4 + 3, 8 * 4 + 0]
    assert step.query_start_loc.tolist() == [0, 1, 4]
    assert step.seq_lens.tolist() == [5, 5]
    assert step.block_tables[0].tolist() == [[3, 6], [5, 8]]
    assert batch.gather_input_ids(step).tolist() == [25, 13, 14, 15]


def test_prepare_pads_block_tables_to_the_longest_row_with_zeros():
    batch = make_batch()
    batch.add_request("a", [1, 2, 3, 4, 5, 6, 7, 8, 9], 8, ([4, 5, 6],))
    batch.add_request("b", [1, 2], 1, ([9],))
    step = batch.prepare(["b", "a"], np.array([1, 1]))
    assert step.block_tables[0].tolist() == [[9, 0, 0], [4, 5, 6]]
    assert step.slot_mapping[0].tolist() == [9 * 4 + 1, 6 * 4 + 0]


def test_pending_token_is_gathered_after_it_is_known():
    # Async scheduling: the step is prepared while the previous one is still sampling the
    # token it feeds; gather_input_ids reads it once it has been appended.
    batch = make_batch()
    batch.add_request("a", [1, 2, 3], 3, ([0],))
    step = batch.prepare(["a"], np.array([1]))
    assert step.positions.tolist() == [3]
    batch.append_tokens(0, [77])
    assert batch.gather_input_ids(step).tolist() == [77]


def test_a_step_stays_valid_while_the_next_is_prepared():
    batch = make_batch()
    batch.add_request("a", [1, 2, 3], 0, ([0],))
    first = batch.prepare(["a"], np.array([3]))
    first_ids = batch.gather_input_ids(first)
    batch.append_tokens(0, [4])
    batch.num_computed_tokens[0] = 3
    second = batch.prepare(["a"], np.array([1]))
    assert batch.gather_input_ids(second).tolist() == [4]
    assert first.positions.tolist() == [0, 1, 2] and first_ids.tolist() == [1, 2, 3]
    third = batch.prepare(["a"], np.array([1]))  # reuses the first step's buffers
    assert np.shares_memory(third.positions, first.positions)


def test_prepare_refuses_more_tokens_than_the_buffers_hold():
    batch = make_batch(max_len=16, max_tokens=4)
    batch.add_request("a", list(range(6)), 0, ([0, 1],))
    with pytest.raises(ValueError, match="tokens scheduled"):
        batch.prepare(["a"], np.array([6]))
