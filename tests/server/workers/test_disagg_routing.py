"""The pair's choice (pagedserve.server.workers.disagg.DisaggRouter.pick) on plain records of
worker slots: roles by slot index, prompts worth a hand-off, and the reason a request runs on
one worker (no prefill worker, no decode worker, a short prompt, a pooling or LoRA request);
and a Handoff's fallbacks driven over plain worker records whose iterators fail as a dead
worker's do (a dead prefill worker, a dead decode worker, workers that keep dying)."""

from __future__ import annotations

from dataclasses import dataclass, field

import pytest

from pagedserve.engine.request.inputs import EngineInput
from pagedserve.engine.request.outputs import DisaggPath
from pagedserve.engine.sampling.params import SamplingParams
from pagedserve.server.workers.disagg import DisaggRouter, WorkerRole, is_disaggregated, prefill_input, slot_role
from pagedserve.server.workers.routing import Router


@dataclass
class Engine:
    name: str
    num_unfinished: int = 0
    stats: None = None


@dataclass
class Slot:
    index: int
    engine: Engine
    is_ready: bool = True
    extra: list = field(default_factory=list)


def router(roles: list[str]) -> DisaggRouter:
    return DisaggRouter(roles, decode_router=Router(), prefill_router=Router(), chunk_size=64, block_size=16)


LONG = list(range(200))


def test_roles_follow_the_slots_and_default_to_both():
    roles = ["prefill", "decode"]
    assert [slot_role(roles, i) for i in range(3)] == [WorkerRole.PREFILL, WorkerRole.DECODE, WorkerRole.BOTH]
    assert slot_role(None, 0) is WorkerRole.BOTH
    assert is_disaggregated(roles) and not is_disaggregated(["decode", "both"]) and not is_disaggregated(None)


def test_a_long_prompt_gets_the_least_loaded_pair():
    slots = [Slot(0, Engine("p0", 3)), Slot(1, Engine("p1", 1)), Slot(2, Engine("d0", 2)), Slot(3, Engine("d1"))]
    h = router(["prefill", "prefill", "decode", "decode"]).pick(slots, LONG, None)
    assert (h.path, h.reason, h.prefill.name, h.decode.name) == (DisaggPath.DISAGGREGATED, None, "p1", "d1")


@pytest.mark.parametrize(
    ("ready", "tokens", "path", "reason", "prefill", "decode"),
    [
        ((True, True), list(range(65)), DisaggPath.DISAGGREGATED, None, "p", "d"),  # 64 tokens to store: one chunk
        ((True, True), list(range(64)), DisaggPath.LOCAL, "short_prompt", None, "d"),  # 48: less than a chunk
        ((False, True), LONG, DisaggPath.FALLBACK, "prefill_unavailable", None, "d"),
        ((True, False), LONG, DisaggPath.FALLBACK, "decode_unavailable", None, "p"),
    ],
)
def test_one_worker_and_why(ready, tokens, path, reason, prefill, decode):
    slots = [Slot(0, Engine("p"), is_ready=ready[0]), Slot(1, Engine("d"), is_ready=ready[1])]
    h = router(["prefill", "decode"]).pick(slots, tokens, None)
    assert (h.path, h.reason, h.decode.name) == (path, reason, decode)
    assert (h.prefill.name if h.prefill else None) == prefill


def test_lora_and_pooling_requests_stay_local():
    from pagedserve.engine.lora.request import LoRARequest
    from pagedserve.engine.request.pooling import PoolingParams

    slots = [Slot(0, Engine("p")), Slot(1, Engine("d"))]
    for reason, extra in (("lora", {"lora": LoRARequest("a", "/x")}), ("pooling", {"pooling": PoolingParams()})):
        inp = EngineInput(None, LONG, SamplingParams(), **extra)
        h = router(["prefill", "decode"]).pick(slots, LONG, inp)
        assert (h.path, h.reason) == (DisaggPath.LOCAL, reason)


def test_the_prefill_input_is_one_greedy_token_written_through():
    inp = EngineInput("x", LONG, SamplingParams(temperature=0.8, max_tokens=300, n=3), cache_salt="t")
    job = prefill_input(inp)
    assert job.kv_produce and job.params.max_tokens == 1 and job.params.n == 1 and job.params.temperature == 0
    assert job.token_ids == LONG and job.cache_salt == "t" and not inp.kv_produce


class Worker:
    """What a Handoff drives on a worker: `generate` (cumulative outputs) and `interrupt`;
    `dies` makes it fail the way a dead worker's iterator does."""

    def __init__(self, name: str, dies: bool = False) -> None:
        self.name, self.dies, self.calls = name, dies, []

    async def generate(self, request_id, inp, *, priority=0, arrival_time=None):
        from pagedserve.engine.core.async_llm import EngineDeadError
        from pagedserve.engine.request.outputs import CompletionOutput, FinishReason, RequestMetrics, RequestOutput

        self.calls.append(inp)
        if self.dies:
            raise EngineDeadError(f"{self.name} died")
        now = arrival_time or 0.0
        done = CompletionOutput(0, "ok", [7], finish_reason=FinishReason.LENGTH)
        yield RequestOutput(
            request_id, None, inp.token_ids, [done], finished=True, metrics=RequestMetrics(now, now, now, now)
        )

    def interrupt(self, request_id, error):
        pass


async def _run(handoff, inp) -> list:
    return [out async for out in handoff.generate("r", inp, arrival_time=1.0)]


def test_a_dead_prefill_worker_falls_back_to_the_decode_workers_own_prefill():
    import asyncio

    from pagedserve.server.workers.disagg import Handoff

    prefill, decode = Worker("p", dies=True), Worker("d")
    inp = EngineInput(None, LONG, SamplingParams(max_tokens=5))
    [out] = asyncio.run(_run(Handoff(prefill, decode, lambda: [decode], DisaggPath.DISAGGREGATED), inp))
    assert out.disagg.path is DisaggPath.FALLBACK and out.disagg.reason == "prefill_failed"
    assert prefill.calls[0].kv_produce and decode.calls == [inp]  # the original request, unchanged


def test_a_dead_decode_worker_waits_for_a_ready_one():
    import asyncio

    from pagedserve.server.workers.disagg import Handoff

    decode, other = Worker("d", dies=True), Worker("o")
    ready: list[list] = [[], [], [other]]  # none ready twice (restarting), then one
    handoff = Handoff(None, decode, lambda: ready.pop(0) if len(ready) > 1 else ready[0], DisaggPath.LOCAL)
    inp = EngineInput(None, LONG, SamplingParams(max_tokens=5))
    [out] = asyncio.run(_run(handoff, inp))
    assert (out.disagg.path, out.disagg.reason, out.disagg.decode_worker) == (DisaggPath.FALLBACK, "decode_failed", "o")


def test_workers_that_keep_dying_fail_the_request():
    import asyncio

    from pagedserve.engine.core.async_llm import EngineDeadError
    from pagedserve.server.workers.disagg import Handoff

    dead = [Worker(f"w{i}", dies=True) for i in range(5)]
    handoff = Handoff(None, dead[0], lambda: dead[1:], DisaggPath.LOCAL, retry_wait_s=0.5)
    with pytest.raises(EngineDeadError):
        asyncio.run(_run(handoff, EngineInput(None, LONG, SamplingParams())))
    assert sum(len(w.calls) for w in dead) == 3  # MAX_ATTEMPTS workers tried, then it fails


def test_a_request_that_is_a_prefill_itself_goes_to_a_prefill_worker():
    slots = [Slot(0, Engine("p")), Slot(1, Engine("d"))]
    assert router(["prefill", "decode"]).pick_producer(slots, LONG).name == "p"
    slots[0].is_ready = False
    assert router(["prefill", "decode"]).pick_producer(slots, LONG) is None
