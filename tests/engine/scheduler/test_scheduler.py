"""Scheduler decisions step by step on tiny pools (block_size 4)."""

from __future__ import annotations

from pagedserve.engine.config.engine import SchedulingPolicy
from pagedserve.engine.request.request import FinishReason, RequestStatus
from pagedserve.engine.scheduler.output import ModelRunnerOutput
from pagedserve.engine.scheduler.scheduler import Scheduler
from tests.engine.kv_helpers import make_manager, make_request


def make_scheduler(num_blocks=16, budget=32, max_seqs=8, max_len=64, policy=SchedulingPolicy.FCFS, caching=True):
    return Scheduler(make_manager(num_blocks, enable_caching=caching), budget, max_seqs, max_len, policy)


def step(sched, tokens: dict[str, int] | None = None):
    """One schedule + a fake model output: every request that reached its end samples `tokens`."""
    out = sched.schedule()
    sampled = {}
    for req_id in out.num_scheduled_tokens:
        req = sched.requests[req_id]
        if req.num_computed_tokens == req.num_tokens:
            sampled[req_id] = [(tokens or {}).get(req_id, 7)]
    results = sched.update_from_output(out, ModelRunnerOutput(sampled))
    return out, results


def test_prefill_then_decode_one_token_per_step():
    s = make_scheduler()
    a = make_request(list(range(10)), request_id="a", max_tokens=3)
    s.add_request(a)
    out, res = step(s)
    assert out.num_scheduled_tokens == {"a": 10}
    assert [n.req_id for n in out.new_requests] == ["a"] and out.new_requests[0].block_ids == ([0, 1, 2],)
    assert res[0].new_token_ids == [7] and not res[0].finished
    out, res = step(s)
    assert out.num_scheduled_tokens == {"a": 1} and out.cached_requests[0].new_block_ids == ([],)
    out, res = step(s)
    assert out.num_scheduled_tokens == {"a": 1}
    assert res[0].finish_reason is FinishReason.LENGTH
    assert not s.has_unfinished_requests() and s.kv.pool.get_num_free_blocks() == 16
    out = s.schedule()
    assert out.finished_req_ids == {"a"} and out.is_empty


def test_chunked_prefill_follows_the_budget():
    s = make_scheduler(budget=8)
    a = make_request(list(range(20)), request_id="a")
    b = make_request(list(range(100, 105)), request_id="b")
    s.add_request(a)
    s.add_request(b)
    out, res = step(s)
    assert out.num_scheduled_tokens == {"a": 8} and res == []  # partial prefill samples nothing
    out, res = step(s)
    assert out.num_scheduled_tokens == {"a": 8}
    out, res = step(s)
    # a finishes its prompt (4 tokens) and samples; b gets the rest of the budget.
    assert out.num_scheduled_tokens == {"a": 4, "b": 4}
    assert [r.request_id for r in res] == ["a"]
    out, res = step(s)
    assert out.num_scheduled_tokens == {"a": 1, "b": 1}
    assert {r.request_id for r in res} == {"a", "b"}


def test_running_first_then_waiting_and_seq_cap():
    s = make_scheduler(max_seqs=2)
    for rid in "abc":
        s.add_request(make_request([1, 2, 3], request_id=rid))
    out, _ = step(s)
    assert list(out.num_scheduled_tokens) == ["a", "b"]
    out, _ = step(s)
    assert list(out.num_scheduled_tokens) == ["a", "b"]
    s.finish_requests(["a"], RequestStatus.FINISHED_ABORTED)
    out, _ = step(s)
    assert list(out.num_scheduled_tokens) == ["b", "c"] and "a" in out.finished_req_ids


def test_preempts_most_recent_when_blocks_run_out_and_recomputes():
    s = make_scheduler(num_blocks=4, budget=64, caching=False)
    a = make_request([1, 2, 3, 4, 5, 6, 7], request_id="a", max_tokens=20)
    b = make_request([9, 9, 9, 9, 9, 9, 9], request_id="b", max_tokens=20)
    s.add_request(a)
    s.add_request(b)
    out, _ = step(s)  # a: blocks 0,1; b: blocks 2,3 (7 prompt tokens each)
    assert out.num_scheduled_tokens == {"a": 7, "b": 7}
    out, _ = step(s)  # 8th token fits in the 2nd block of each
    assert out.num_scheduled_tokens == {"a": 1, "b": 1}
    out, _ = step(s)  # a needs a 3rd block: b (scheduled last) is preempted
    assert out.num_scheduled_tokens == {"a": 1} and out.preempted_req_ids == {"b"}
    assert b.status is RequestStatus.PREEMPTED and b.num_computed_tokens == 0
    assert b.num_output_tokens == 2  # its generated tokens are kept and recomputed
    assert s.kv.get_block_ids("a") == [0, 1, 3]
    # b stays out until blocks free up: it waits, it is not scheduled again while a runs.
    out, _ = step(s)
    assert out.num_scheduled_tokens == {"a": 1}
    s.finish_requests(["a"], RequestStatus.FINISHED_ABORTED)
    out, _ = step(s)
    assert out.num_scheduled_tokens == {"b": 9}  # 7 prompt + 2 outputs recomputed
    assert out.new_requests[0].token_ids == b.prompt_token_ids + [7, 7]


def test_request_needing_a_block_preempts_the_one_scheduled_last():
    s = make_scheduler(num_blocks=3, caching=False)
    a = make_request([1] * 8, request_id="a", max_tokens=30)
    b = make_request([2] * 3, request_id="b", max_tokens=30)
    s.add_request(a)
    s.add_request(b)
    step(s)  # a: 0,1  b: 2
    out, _ = step(s)  # a needs block 3 -> preempts b
    assert out.preempted_req_ids == {"b"} and out.num_scheduled_tokens == {"a": 1}


def test_last_running_request_preempts_itself_and_is_recomputed_later():
    """b is the last running request and needs a block while a holds the others: the victim is
    b itself. It is not scheduled, waits while the pool is full, and comes back as a new
    request with its generated token once a finishes."""
    s = make_scheduler(num_blocks=3, caching=False)
    a = make_request([1] * 6, request_id="a", max_tokens=3)
    b = make_request([2] * 4, request_id="b", max_tokens=5)
    s.add_request(a)
    s.add_request(b)

    out, res = step(s)  # a: blocks 0,1 (room for 8 tokens); b: block 2 (full)
    assert out.num_scheduled_tokens == {"a": 6, "b": 4}
    assert [(n.req_id, n.block_ids) for n in out.new_requests] == [("a", ([0, 1],)), ("b", ([2],))]
    assert [r.request_id for r in res] == ["a", "b"]

    out, res = step(s)  # a's 7th token fits its blocks; b's 5th needs a 2nd block: none is free
    assert out.num_scheduled_tokens == {"a": 1} and out.preempted_req_ids == {"b"}
    assert [(c.req_id, c.new_block_ids) for c in out.cached_requests] == [("a", ([],))]
    assert out.new_requests == [] and [r.request_id for r in res] == ["a"]
    assert b.status is RequestStatus.PREEMPTED and b.num_computed_tokens == 0 and b.num_preemptions == 1
    assert b.all_token_ids == [2, 2, 2, 2, 7]  # its sampled token is kept, to be recomputed
    assert s.running == [a] and list(s.waiting) == [b] and s.num_preemptions == 1
    assert s.kv.get_block_ids("b") == [] and s.kv.pool.free_queue.block_ids() == [2]

    out, res = step(s)  # b needs 2 blocks, only block 2 is free: it waits; a finishes
    assert out.num_scheduled_tokens == {"a": 1} and out.preempted_req_ids == set()
    assert out.new_requests == [] and list(s.waiting) == [b]
    assert res[0].request_id == "a" and res[0].finish_reason is FinishReason.LENGTH
    assert s.kv.pool.free_queue.block_ids() == [2, 1, 0]  # a's blocks came back tail first

    out, res = step(s)  # b resumes from scratch in the blocks at the head of the queue
    assert out.finished_req_ids == {"a"}
    assert out.num_scheduled_tokens == {"b": 5}
    assert [(n.req_id, n.token_ids, n.block_ids, n.num_computed_tokens) for n in out.new_requests] == [
        ("b", [2, 2, 2, 2, 7], ([2, 1],), 0)
    ]
    assert res[0].request_id == "b" and b.num_output_tokens == 2 and b.status is RequestStatus.RUNNING


def test_prefix_cache_hit_is_counted_as_computed():
    s = make_scheduler()
    a = make_request(list(range(12)), request_id="a", max_tokens=1)
    s.add_request(a)
    step(s)
    b = make_request(list(range(12)) + [40, 41], request_id="b")
    s.add_request(b)
    out, _ = step(s)
    assert out.num_scheduled_tokens == {"b": 2}
    assert out.new_requests[0].num_computed_tokens == 12 and b.num_cached_tokens == 12
    assert out.new_requests[0].block_ids[0][:3] == [0, 1, 2]


def test_priority_policy_orders_waiting_and_picks_victim():
    s = make_scheduler(num_blocks=4, max_seqs=2, policy=SchedulingPolicy.PRIORITY, caching=False)
    low = make_request([1] * 7, request_id="low", priority=5, arrival_time=1.0, max_tokens=20)
    high = make_request([2] * 7, request_id="high", priority=0, arrival_time=2.0, max_tokens=20)
    s.add_request(low)
    s.add_request(high)
    out, _ = step(s)
    assert list(out.num_scheduled_tokens) == ["high", "low"]
    step(s)
    out, _ = step(s)  # high needs a block; the victim is the worst priority, low
    assert out.preempted_req_ids == {"low"} and out.num_scheduled_tokens == {"high": 1}


def test_priority_victim_already_scheduled_this_step_is_unscheduled():
    s = make_scheduler(num_blocks=4, policy=SchedulingPolicy.PRIORITY, caching=False)
    low = make_request([1] * 7, request_id="low", priority=5, arrival_time=1.0, max_tokens=20)
    high = make_request([2] * 7, request_id="high", priority=0, arrival_time=2.0, max_tokens=20)
    s.add_request(low)
    step(s)
    s.add_request(high)
    step(s)  # running order: low, high
    out, _ = step(s)  # low first (fits a block? no: both need a third block)
    assert out.preempted_req_ids == {"low"}
    assert out.num_scheduled_tokens == {"high": 1}
    assert [c.req_id for c in out.cached_requests] == ["high"]


def test_stop_conditions():
    s = make_scheduler()
    eos = frozenset({0})
    s.add_request(make_request([5, 5], request_id="eos", eos=eos))
    s.add_request(make_request([5, 5], request_id="ign", eos=eos, ignore_eos=True, max_tokens=2))
    s.add_request(make_request([5, 5], request_id="stoptok", stop_token_ids=[3]))
    s.add_request(make_request([5, 5], request_id="min", eos=eos, min_tokens=2, max_tokens=5))
    _, res = step(s, {"eos": 0, "ign": 0, "stoptok": 3, "min": 0})
    by_id = {r.request_id: r for r in res}
    assert by_id["eos"].finish_reason is FinishReason.STOP and by_id["eos"].stop_reason is None
    assert by_id["stoptok"].finish_reason is FinishReason.STOP and by_id["stoptok"].stop_reason == 3
    assert not by_id["ign"].finished and not by_id["min"].finished
    _, res = step(s, {"ign": 0, "min": 0})
    by_id = {r.request_id: r for r in res}
    assert by_id["ign"].finish_reason is FinishReason.LENGTH
    assert by_id["min"].finish_reason is FinishReason.STOP


def test_max_model_len_stops_generation():
    s = make_scheduler(max_len=6)
    s.add_request(make_request([1, 2, 3, 4], request_id="a", max_tokens=50))
    step(s)
    _, res = step(s)
    assert res[0].finish_reason is FinishReason.LENGTH


def test_abort_waiting_and_running_frees_everything():
    s = make_scheduler(max_seqs=1)
    s.add_request(make_request(list(range(9)), request_id="a"))
    s.add_request(make_request(list(range(9)), request_id="b"))
    step(s)
    s.finish_requests(["a", "b", "unknown"], RequestStatus.FINISHED_ABORTED)
    assert not s.has_unfinished_requests()
    assert s.kv.pool.get_num_free_blocks() == 16 and not s.kv.req_to_blocks
