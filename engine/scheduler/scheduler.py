"""The phase-free scheduler: spends a token budget over running, then waiting requests."""

from __future__ import annotations

import time
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from pagedserve.engine.config.engine import SchedulingPolicy
from pagedserve.engine.kv_cache.manager import KVCacheBlocks, KVCacheManager
from pagedserve.engine.request.request import FinishReason, Request, RequestStatus
from pagedserve.engine.scheduler.output import (
    CachedRequestData,
    EngineCoreOutput,
    ModelRunnerOutput,
    NewRequestData,
    SchedulerOutput,
)
from pagedserve.engine.scheduler.queues import make_waiting_queue

if TYPE_CHECKING:
    from pagedserve.engine.kv_offload.manager import KVOffloadManager


_FINISHED_STATUS = {status.finish_reason: status for status in RequestStatus if status.is_finished}


@dataclass(slots=True)
class _StepPlan:
    """What one schedule() call has decided so far, and the token budget it has left."""

    budget: int
    num_scheduled: dict[str, int] = field(default_factory=dict)
    spec_tokens: dict[str, list[int]] = field(default_factory=dict)
    new_requests: list[NewRequestData] = field(default_factory=list)
    cached_requests: list[CachedRequestData] = field(default_factory=list)
    preempted: set[str] = field(default_factory=set)

    def schedule(self, req_id: str, num_tokens: int) -> None:
        self.num_scheduled[req_id] = num_tokens
        self.budget -= num_tokens

    def unschedule(self, req_id: str) -> None:
        """Take back a running request's share of this step (it is being preempted)."""
        if req_id in self.num_scheduled:
            self.budget += self.num_scheduled.pop(req_id)
            self.spec_tokens.pop(req_id, None)
            self.cached_requests = [c for c in self.cached_requests if c.req_id != req_id]


class Scheduler:
    """Each step maps request ids to a number of tokens to compute.

    A request needs `num_tokens - num_computed_tokens` more tokens: its whole prompt at first
    (sliced by the budget: chunked prefill), then one token per step. When the pool runs out of
    blocks, the running request scheduled last (FCFS) or with the worst priority is preempted:
    its blocks are freed and it is recomputed later.

    Async scheduling (`async_scheduling`): the next step is scheduled before the outputs of the
    running one arrive. Each scheduled step that samples a request's next token counts one
    placeholder token for it (known to come, not yet known), so the request is scheduled to
    decode that token at once; `update_from_output` turns placeholders into tokens. A request
    found finished one step late was scheduled once more: that step's token is dropped. A
    request preempted while the step computing its token ran keeps that token, as it would
    have without async scheduling.
    """

    def __init__(
        self,
        kv_manager: KVCacheManager,
        max_num_batched_tokens: int,
        max_num_seqs: int,
        max_model_len: int,
        policy: SchedulingPolicy = SchedulingPolicy.FCFS,
        kv_offload: KVOffloadManager | None = None,
        max_loras: int | None = None,
        async_scheduling: bool = False,
    ) -> None:
        self.kv = kv_manager
        self.async_scheduling = async_scheduling
        # Async scheduling: request id -> tokens scheduled to be sampled whose value is not known yet.
        self._placeholders: dict[str, int] = {}
        # At most this many LoRA adapters among the running requests (the runner's slots).
        self.max_loras = max_loras
        # KV offload tiers (LMCache): asked for more of a waiting request's prefix than the
        # block pool holds, and restores it into the request's fresh blocks.
        self.kv_offload = kv_offload
        self.max_num_batched_tokens = max_num_batched_tokens
        self.max_num_seqs = max_num_seqs
        self.max_model_len = max_model_len
        self.policy = policy
        self.requests: dict[str, Request] = {}
        self.waiting = make_waiting_queue(policy)
        self.running: list[Request] = []
        # Ids the runner must forget at the next step.
        self._finished_ids: set[str] = set()
        self.num_preemptions = 0
        # Speculative decoding: drafts verified, and how many of them the target kept.
        self.num_draft_tokens = 0
        self.num_accepted_tokens = 0

    # -- requests in and out ---------------------------------------------------------------
    def add_request(self, request: Request) -> None:
        if request.request_id in self.requests:
            raise ValueError(f"duplicate request id {request.request_id!r}")
        if request.num_tokens >= self.max_model_len:
            raise ValueError(
                f"prompt has {request.num_tokens} tokens; max_model_len is {self.max_model_len} "
                "(at least one token must be left to generate)"
            )
        self.requests[request.request_id] = request
        self.waiting.add(request)

    def finish_requests(self, request_ids: Iterable[str], status: RequestStatus) -> None:
        """End requests from outside (abort, stop string found by the detokenizer)."""
        for req_id in request_ids:
            request = self.requests.get(req_id)
            if request is None or request.is_finished:
                continue
            if request.status is RequestStatus.RUNNING:
                self.running.remove(request)
            else:
                self.waiting.remove(request)
            self._free(request, status)

    def _free(self, request: Request, status: RequestStatus) -> None:
        request.status = status
        self._placeholders.pop(request.request_id, None)
        self.kv.free(request)
        del self.requests[request.request_id]
        self._finished_ids.add(request.request_id)
        if self.kv_offload is not None:
            self.kv_offload.forget(request.request_id)

    @property
    def num_unfinished(self) -> int:
        return len(self.requests)

    def has_unfinished_requests(self) -> bool:
        return bool(self.requests)

    # -- scheduling ------------------------------------------------------------------------
    def schedule(self) -> SchedulerOutput:
        """Spend the token budget on the running requests, then (unless one had to be
        preempted) on the waiting ones; returns what the runner computes this step."""
        plan = _StepPlan(self.max_num_batched_tokens)
        self._schedule_running(plan)
        if not plan.preempted:
            self._schedule_waiting(plan)
        output = SchedulerOutput(
            new_requests=plan.new_requests,
            cached_requests=plan.cached_requests,
            num_scheduled_tokens=plan.num_scheduled,
            total_num_scheduled_tokens=self.max_num_batched_tokens - plan.budget,
            finished_req_ids=self._finished_ids,
            preempted_req_ids=plan.preempted,
            scheduled_spec_tokens=plan.spec_tokens,
        )
        self._finished_ids = set()
        # Tokens scheduled now count as computed: the next schedule() may run before outputs
        # arrive (the runner computes exactly what was scheduled).
        for req_id, n in plan.num_scheduled.items():
            request = self.requests[req_id]
            request.num_computed_tokens += n
            if (
                self.async_scheduling
                and request.pooling_params is None
                and (request.num_computed_tokens >= request.num_tokens + self._placeholders.get(req_id, 0))
            ):
                self._placeholders[req_id] = self._placeholders.get(req_id, 0) + 1
        return output

    def _schedule_running(self, plan: _StepPlan) -> None:
        """Running requests in order; one that cannot get blocks preempts others, or itself."""
        for request in list(self.running):
            if plan.budget <= 0:
                return
            if request.status is not RequestStatus.RUNNING:
                continue  # preempted earlier in this step
            num_new = self._num_new_tokens(request, plan.budget)
            if num_new == 0:
                continue
            new_blocks = self._allocate_or_preempt(request, num_new, plan)
            if new_blocks is None:
                continue  # it preempted itself
            plan.schedule(request.request_id, num_new)
            num_drafts = num_new - (request.num_tokens - request.num_computed_tokens)
            if num_drafts > 0:  # the budget may have cut some drafts
                plan.spec_tokens[request.request_id] = request.spec_token_ids[:num_drafts]
            plan.cached_requests.append(
                CachedRequestData(request.request_id, new_blocks.block_ids(), request.num_computed_tokens)
            )

    def _allocate_or_preempt(self, request: Request, num_new: int, plan: _StepPlan) -> KVCacheBlocks | None:
        """Blocks for `num_new` more tokens of a running request, preempting victims until they
        fit. None when the request had to preempt itself (no other victim was left)."""
        while (new_blocks := self.kv.allocate_slots(request, num_new)) is None:
            victim = self._pick_victim()
            plan.unschedule(victim.request_id)  # the priority policy may pick one scheduled earlier
            self._preempt(victim)
            plan.preempted.add(victim.request_id)
            if victim is request:
                return None
        return new_blocks

    def _schedule_waiting(self, plan: _StepPlan) -> None:
        """Waiting requests in queue order while budget, sequence slots and blocks last. A
        request whose grammar is still compiling stays waiting, in its place, without holding
        up the others. So does one whose LoRA adapter would exceed `max_loras` adapters among the
        running requests."""
        not_ready: list[Request] = []
        now = time.monotonic()
        loras = {r.lora_id for r in self.running if r.lora_id is not None}
        while self.waiting and plan.budget > 0 and len(self.running) < self.max_num_seqs:
            request = self.waiting.peek()
            if request.grammar is not None and not request.grammar.poll(now):
                not_ready.append(self.waiting.pop())
                continue
            if (
                request.lora_id is not None
                and request.lora_id not in loras
                and self.max_loras is not None
                and len(loras) >= self.max_loras
            ):
                not_ready.append(self.waiting.pop())
                continue
            if not self._admit(request, plan):
                break
            if request.lora_id is not None:
                loras.add(request.lora_id)
        for request in reversed(not_ready):
            self.waiting.prepend(request)

    def _admit(self, request: Request, plan: _StepPlan) -> bool:
        """Schedule the head of the waiting queue from its longest cached prefix (prefix cache,
        then the offload tiers); False when the pool lacks the blocks (it stays at the head)."""
        hit_blocks, num_hit_tokens = self.kv.get_computed_blocks(request)
        # Before its own blocks are published (they would read as "evicted"); once per request.
        miss = (
            self.kv.prefix_miss(request, num_hit_tokens // self.kv.block_size)
            if request.first_scheduled_time is None
            else None
        )
        num_external = self.kv_offload.lookup(request, num_hit_tokens) if self.kv_offload else 0
        request.num_computed_tokens = num_hit_tokens + num_external
        num_new = self._num_new_tokens(request, plan.budget)
        if self.kv.allocate_slots(request, num_new, hit_blocks) is None:
            request.num_computed_tokens = 0
            return False
        num_loaded = 0
        if num_external:
            num_loaded = self._load_external(request, num_hit_tokens, num_external, plan.budget)
            num_new = self._num_new_tokens(request, plan.budget)
        self.waiting.pop()
        if request.first_scheduled_time is None:
            request.num_cached_tokens = num_hit_tokens
            request.num_external_cached_tokens = num_loaded
            request.prefix_miss = miss
            request.first_scheduled_time = time.monotonic()
        request.status = RequestStatus.RUNNING
        self.running.append(request)
        plan.schedule(request.request_id, num_new)
        plan.new_requests.append(
            NewRequestData(
                req_id=request.request_id,
                token_ids=list(request.all_token_ids),
                num_prompt_tokens=request.num_prompt_tokens,
                sampling_params=request.sampling_params,
                block_ids=self.kv.get_group_block_ids(request.request_id),
                num_computed_tokens=request.num_computed_tokens,
                pooling_params=request.pooling_params,
                lora=request.lora,
            )
        )
        return True

    def _load_external(self, request: Request, start: int, num_tokens: int, budget: int) -> int:
        """Restore tokens [start, start + num_tokens) from the offload tiers into the request's
        freshly allocated blocks; returns how many arrived. Only those count as computed: on a
        shortfall the blocks that were not filled leave the prefix cache again and the rest is
        recomputed (the blocks already allocated cover it: the computed count only went down).
        """
        assert self.kv_offload is not None  # only a lookup in the offload tiers finds external tokens
        loaded = self.kv_offload.load(request, self.kv.get_block_ids(request.request_id), start, start + num_tokens)
        if loaded < num_tokens:
            request.num_computed_tokens = start + loaded
            num_new = self._num_new_tokens(request, budget)
            self.kv.rewind_cached_blocks(request, start + loaded, start + loaded + num_new)
        return loaded

    def _num_new_tokens(self, request: Request, budget: int) -> int:
        remaining = (
            request.num_tokens
            + self._placeholders.get(request.request_id, 0)
            + len(request.spec_token_ids)
            - request.num_computed_tokens
        )
        return max(0, min(remaining, budget, self.max_model_len - request.num_computed_tokens))

    def _pick_victim(self) -> Request:
        if self.policy is SchedulingPolicy.PRIORITY:
            return max(self.running, key=lambda r: (r.priority, r.arrival_time))
        return self.running[-1]

    def _preempt(self, request: Request) -> None:
        self.running.remove(request)
        self.kv.free(request)
        self._placeholders.pop(request.request_id, None)  # it is recomputed from its known tokens
        request.status = RequestStatus.PREEMPTED
        request.num_computed_tokens = 0
        request.spec_token_ids = []
        request.num_preemptions += 1
        self.num_preemptions += 1
        self.waiting.prepend(request)

    # -- results ---------------------------------------------------------------------------
    def update_from_output(
        self, scheduler_output: SchedulerOutput, runner_output: ModelRunnerOutput
    ) -> list[EngineCoreOutput]:
        """Append sampled tokens, apply token-level stop conditions, free finished requests
        (a pooling request finishes with its pooled vector)."""
        outputs = [
            self._finish_pooled(req_id, pooled)
            for req_id, pooled in runner_output.pooled.items()
            if req_id in self.requests and self.requests[req_id].status is RequestStatus.RUNNING
        ]
        for req_id, token_ids in runner_output.sampled_token_ids.items():
            request = self.requests.get(req_id)
            if request is None or request.status not in (RequestStatus.RUNNING, RequestStatus.PREEMPTED):
                continue  # finished or aborted since the step was scheduled: the token is dropped
            # (PREEMPTED: async scheduling preempted it while the step that computes this token ran)
            if req_id in self._placeholders:
                self._placeholders[req_id] -= 1
                if not self._placeholders[req_id]:
                    del self._placeholders[req_id]
            drafts = scheduler_output.scheduled_spec_tokens.get(req_id)
            request.spec_token_ids = []
            if drafts:
                # token_ids = the drafts kept + one token of the target's: the rest were
                # computed for nothing (their KV slots are rewritten later).
                request.num_computed_tokens -= len(drafts) + 1 - len(token_ids)
                self.num_draft_tokens += len(drafts)
                self.num_accepted_tokens += len(token_ids) - 1
            kept: list[int] = []
            finish_reason = error = None
            for token in token_ids:  # a stop in the middle drops what follows it
                request.append_output_token_ids([token])
                kept.append(token)
                if request.grammar is not None and not request.grammar.accept(token):
                    # Cannot happen while the bitmask is applied; never continue off the grammar.
                    error = "the sampled token does not fit the grammar"
                    finish_reason = FinishReason.ABORT
                else:
                    finish_reason = self._check_stop(request)
                if finish_reason is not None:
                    break
            token_ids = kept
            if finish_reason is not None:
                if request.status is RequestStatus.RUNNING:
                    self.running.remove(request)
                else:
                    self.waiting.remove(request)
                self._free(request, _FINISHED_STATUS[finish_reason])
            logprobs = runner_output.logprobs.get(req_id)
            outputs.append(
                EngineCoreOutput(
                    request_id=req_id,
                    new_token_ids=token_ids,
                    new_logprobs=logprobs,
                    finish_reason=finish_reason,
                    stop_reason=request.stop_reason,
                    error=error,
                    # Set at first scheduling: a request with a token has been scheduled.
                    num_cached_tokens=request.num_cached_tokens,
                    num_external_cached_tokens=request.num_external_cached_tokens,
                    prefix_miss=_miss_wire(request),
                    first_scheduled_time=request.first_scheduled_time,
                    kv_transfer_s=request.kv_transfer_s,
                    kv_transfer_bytes=request.kv_transfer_bytes,
                )
            )
        # Sliding-window groups return what the next queries cannot see (hybrid KV cache).
        for req_id in scheduler_output.num_scheduled_tokens:
            request = self.requests.get(req_id)
            if request is not None and request.status is RequestStatus.RUNNING:
                self.kv.remove_skipped_blocks(request)
        return outputs

    def _finish_pooled(self, req_id: str, pooled: list[float]) -> EngineCoreOutput:
        request = self.requests[req_id]
        self.running.remove(request)
        self._free(request, RequestStatus.FINISHED_STOPPED)
        return EngineCoreOutput(
            request_id=req_id,
            new_token_ids=[],
            finish_reason=FinishReason.STOP,
            pooled=pooled,
            num_cached_tokens=request.num_cached_tokens,
            num_external_cached_tokens=request.num_external_cached_tokens,
            prefix_miss=_miss_wire(request),
            first_scheduled_time=request.first_scheduled_time,
        )

    def _check_stop(self, request: Request) -> FinishReason | None:
        params = request.sampling_params
        last = request.all_token_ids[-1]
        if request.num_output_tokens >= params.min_tokens:
            if not params.ignore_eos and last in request.eos_token_ids:
                return FinishReason.STOP
            if last in params.stop_token_ids:
                request.stop_reason = last
                return FinishReason.STOP
        if request.grammar is not None and request.grammar.is_terminated:
            return FinishReason.STOP  # the grammar is complete (even with ignore_eos)
        if params.max_tokens is not None and request.num_output_tokens >= params.max_tokens:
            return FinishReason.LENGTH
        if request.num_tokens >= self.max_model_len:
            return FinishReason.LENGTH
        return None


def _miss_wire(request: Request) -> tuple[str, int] | None:
    """The request's prefix-cache miss as the output carries it: (cause, tokens)."""
    miss = request.prefix_miss
    return None if miss is None else (miss.cause.value, miss.num_tokens)
