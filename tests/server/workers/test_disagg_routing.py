"""The pair's choice (pagedserve.server.workers.disagg.DisaggRouter.pick) on plain records of
worker slots: roles by slot index, prompts worth a hand-off, and the reason a request runs on
one worker (no prefill worker, no decode worker, a short prompt, a pooling or LoRA request)."""

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
    for extra in ({"lora": LoRARequest("a", "/x")}, {"pooling": PoolingParams()}):
        inp = EngineInput(None, LONG, SamplingParams(), **extra)
        h = router(["prefill", "decode"]).pick(slots, LONG, inp)
        assert (h.path, h.reason) == (DisaggPath.LOCAL, "short_prompt")


def test_the_prefill_input_is_one_greedy_token_written_through():
    inp = EngineInput("x", LONG, SamplingParams(temperature=0.8, max_tokens=300, n=3), cache_salt="t")
    job = prefill_input(inp)
    assert job.kv_produce and job.params.max_tokens == 1 and job.params.n == 1 and job.params.temperature == 0
    assert job.token_ids == LONG and job.cache_salt == "t" and not inp.kv_produce
