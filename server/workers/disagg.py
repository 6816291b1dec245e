"""Disaggregated prefill and decode: a version's workers in roles, and one request's hand-off.

A version whose model-config lists `workerRoles` (or that was registered with `worker_roles`)
has workers in three roles, one per worker slot in order (slots past the list are `both`):

- `prefill`: computes prompts only. The front end sends it a new request with `max_tokens: 1`
  semantics and `kv_produce` set: the engine stores the prompt's KV through its offload
  connector (LMCache) and waits until the writes reached the shared tiers (a disk folder both
  workers point at on one machine, the Redis tier across machines) before it reports the
  request finished. Its one token is dropped.
- `decode`: gets the request itself afterwards. Its scheduler's offload lookup finds the whole
  prompt but its last partial block in the shared tier, loads it into fresh blocks, computes
  the few tokens left and goes on decoding. A long prompt therefore never occupies a decode
  worker's steps, so the decode workers' other requests keep a steady inter-token latency.
- `both`: today's workers; they serve every request themselves, and take decode's part too.

`DisaggRouter.pick` chooses the pair: the prefill worker by the version's routing policy over
the prefill workers (prefix affinity keeps a prompt's prefix cache warm there), the decode
worker by the same policy over the decode and both workers (load first; its prefix cache holds
what it loaded). A request that gains nothing from a hand-off runs locally on a decode worker:
a prompt shorter than one offload chunk (the connector stores whole chunks), a pooling request,
one under a LoRA adapter. `Handoff` runs the request: it is what the request path calls
`generate` and `interrupt` on, like a worker.

Failures never lose a request. No prefill worker ready (restarting after a crash), a prefill
worker that dies or ends the prompt abnormally: the decode worker prefills the prompt itself
(it still loads whatever chunks already landed). No decode worker ready: the prefill worker
serves the whole request. A decode worker that dies before its first token: the request runs
again on another ready worker. A decode worker that dies after tokens were sent fails the
request as any worker's death does (the tokens are already with the client). Cancellation (a
client gone, a deadline) aborts the request on whichever worker holds it. Each of these is a
`fallback` in the metrics, with its reason.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import enum
import time
from collections.abc import AsyncGenerator, AsyncIterator, Callable, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, cast

from pagedserve.engine.config.kv_offload import DEFAULT_CHUNK_SIZE
from pagedserve.engine.core.async_llm import EngineDeadError
from pagedserve.engine.request.outputs import DisaggPath, DisaggTimings, FinishReason, RequestMetrics, RequestOutput
from pagedserve.engine.sampling.params import SamplingParams
from pagedserve.server.workers.routing import Router

RETRY_POLL_S = 0.25  # how often a request whose workers all died looks for a ready one
MAX_ATTEMPTS = 3  # workers a request is tried on before their deaths fail it

if TYPE_CHECKING:
    from pagedserve.engine.core.async_llm import AsyncLLM
    from pagedserve.engine.request.inputs import EngineInput
    from pagedserve.server.workers.pool import WorkerSlot


class WorkerRole(str, enum.Enum):
    PREFILL = "prefill"
    DECODE = "decode"
    BOTH = "both"


def slot_role(roles: Sequence[str] | None, index: int) -> WorkerRole:
    """The role of the worker in slot `index`: its entry of `roles`, `both` past the list."""
    if roles is None or index >= len(roles):
        return WorkerRole.BOTH
    return WorkerRole(roles[index])


def is_disaggregated(roles: Sequence[str] | None) -> bool:
    return bool(roles) and WorkerRole.PREFILL.value in roles  # type: ignore[operator]


@dataclass(slots=True, eq=False)
class DisaggRouter:
    """Chooses the prefill and decode workers of each request of one version."""

    roles: list[str]
    decode_router: Router  # the version's own router, over the decode and both workers
    prefill_router: Router
    chunk_size: int = DEFAULT_CHUNK_SIZE  # the offload connector stores whole chunks
    block_size: int = 16
    retry_wait_s: float = 120.0  # the version's responseTimeout

    def by_role(self, slots: Sequence[WorkerSlot]) -> dict[WorkerRole, list[AsyncLLM]]:
        out: dict[WorkerRole, list[AsyncLLM]] = {role: [] for role in WorkerRole}
        for slot in slots:
            if slot.is_ready and slot.engine is not None:
                out[slot_role(self.roles, slot.index)].append(slot.engine)
        return out

    def why_local(self, inp: EngineInput | None, num_tokens: int) -> str | None:
        """Why a request is not worth a hand-off (None: it is): a pooling request, one under a
        LoRA adapter, or a prompt with less than one whole chunk to store (the last token is
        always computed by the decode worker)."""
        if inp is not None and inp.pooling is not None:
            return "pooling"
        if inp is not None and inp.lora is not None:
            return "lora"
        if (num_tokens - 1) // self.block_size * self.block_size < self.chunk_size:
            return "short_prompt"
        return None

    def pick_producer(self, slots: Sequence[WorkerSlot], token_ids: Sequence[int]) -> AsyncLLM | None:
        """For a request that asks to be a prefill itself (vLLM's kv_transfer_params from a proxy):
        a ready prefill worker, or None (any worker then)."""
        prefills = self.by_role(slots)[WorkerRole.PREFILL]
        return self.prefill_router.route(prefills, token_ids).engine if prefills else None

    def pick(self, slots: Sequence[WorkerSlot], token_ids: Sequence[int], inp: EngineInput | None) -> Handoff:
        """The pair for a prompt of `token_ids` (or the one worker it runs on, and why)."""
        workers = self.by_role(slots)
        decoders = workers[WorkerRole.DECODE] + workers[WorkerRole.BOTH]
        prefills = workers[WorkerRole.PREFILL]

        def alternatives() -> list[AsyncLLM]:  # where a request goes when its decode worker died
            now = self.by_role(slots)
            return now[WorkerRole.DECODE] + now[WorkerRole.BOTH] + now[WorkerRole.PREFILL]

        if not decoders:  # the prefill worker serves it whole
            engine = self.prefill_router.route(prefills, token_ids).engine
            return Handoff(
                None, engine, alternatives, DisaggPath.FALLBACK, "decode_unavailable", retry_wait_s=self.retry_wait_s
            )
        decode = self.decode_router.route(decoders, token_ids).engine
        local = self.why_local(inp, len(token_ids))
        if local is not None:
            return Handoff(None, decode, alternatives, DisaggPath.LOCAL, local, retry_wait_s=self.retry_wait_s)
        if not prefills:
            return Handoff(
                None, decode, alternatives, DisaggPath.FALLBACK, "prefill_unavailable", retry_wait_s=self.retry_wait_s
            )
        prefill = self.prefill_router.route(prefills, token_ids).engine
        return Handoff(prefill, decode, alternatives, DisaggPath.DISAGGREGATED, retry_wait_s=self.retry_wait_s)


@dataclass(slots=True, eq=False)
class Handoff:
    """One request's run over a prefill and a decode worker (or one worker, with the reason):
    `generate` and `interrupt` as a worker's, so the request path treats it as one."""

    prefill: AsyncLLM | None
    decode: AsyncLLM
    alternatives: Callable[[], list[AsyncLLM]]
    path: DisaggPath
    reason: str | None = None
    retry_wait_s: float = 120.0  # how long a request whose worker died waits for another one
    _active: dict[str, AsyncLLM] = field(default_factory=dict)  # request id -> the worker holding it
    _interrupted: dict[str, BaseException] = field(default_factory=dict)

    @property
    def name(self) -> str:
        return self.decode.name

    def interrupt(self, request_id: str, error: BaseException) -> None:
        """Interrupt the request on whichever worker holds it (or before the next one gets it)."""
        self._interrupted[request_id] = error
        worker = self._active.get(request_id)
        if worker is not None:
            worker.interrupt(request_id, error)

    async def generate(
        self, request_id: str, inp: EngineInput, *, priority: int = 0, arrival_time: float | None = None
    ) -> AsyncIterator[RequestOutput]:
        arrival = arrival_time if arrival_time is not None else time.monotonic()
        try:
            prefill_out = None
            if self.prefill is not None:
                prefill_out = await self._prefill(request_id, inp, priority, arrival)
            handed_at = time.monotonic()
            tried: set[str] = set()
            decode = self.decode
            for attempt in range(MAX_ATTEMPTS):
                self._check_interrupted(request_id)
                tried.add(decode.name)
                self._active[request_id] = decode
                sent = False
                try:
                    async with contextlib.aclosing(
                        _closable(decode.generate(request_id, inp, priority=priority, arrival_time=handed_at))
                    ) as outputs:
                        async for out in outputs:
                            if out.finished:
                                self._finish(out, prefill_out, arrival, handed_at, decode)
                            sent = True
                            yield out
                    return
                except EngineDeadError:
                    if sent or attempt == MAX_ATTEMPTS - 1:
                        raise
                    self._fall_back("decode_failed")
                    decode = await self._another_worker(request_id, tried)
        finally:
            self._active.pop(request_id, None)
            self._interrupted.pop(request_id, None)

    async def _prefill(self, request_id: str, inp: EngineInput, priority: int, arrival: float) -> RequestOutput | None:
        """Run the prompt on the prefill worker; its finished output, or None (fallen back)."""
        assert self.prefill is not None
        self._active[request_id] = self.prefill
        job = prefill_input(inp)
        last = None
        try:
            async with contextlib.aclosing(
                _closable(self.prefill.generate(request_id, job, priority=priority, arrival_time=arrival))
            ) as outputs:
                async for out in outputs:
                    last = out
        except EngineDeadError:
            self._fall_back("prefill_failed")
            return None
        if last is None or not last.finished or any(c.finish_reason is FinishReason.ABORT for c in last.outputs):
            self._fall_back("prefill_failed")
            return None
        return last

    async def _another_worker(self, request_id: str, tried: set[str]) -> AsyncLLM:
        """A ready worker not tried yet, or (none now: both sides restarting) the first one ready
        again within `retry_wait_s`; EngineDeadError after that."""
        deadline = time.monotonic() + self.retry_wait_s
        while True:
            self._check_interrupted(request_id)  # a client gone, a deadline: stop waiting
            ready = self.alternatives()
            fresh = [w for w in ready if w.name not in tried]
            if fresh or ready:
                return (fresh or ready)[0]
            if time.monotonic() > deadline:
                raise EngineDeadError(f"no worker of the version became ready within {self.retry_wait_s:g} s")
            await asyncio.sleep(RETRY_POLL_S)

    def _fall_back(self, reason: str) -> None:
        self.path, self.reason = DisaggPath.FALLBACK, reason

    def _check_interrupted(self, request_id: str) -> None:
        error = self._interrupted.get(request_id)
        if error is not None:
            raise error

    def _finish(
        self,
        out: RequestOutput,
        prefill_out: RequestOutput | None,
        arrival: float,
        handed_at: float,
        decode: AsyncLLM,
    ) -> None:
        """The request's metrics from its arrival, and its TTFT phases (see DisaggTimings)."""
        d = out.metrics
        timings = DisaggTimings(
            path=self.path,
            reason=self.reason,
            prefill_worker=self.prefill.name if prefill_out is not None and self.prefill is not None else None,
            decode_worker=decode.name,
            transfer_bytes=out.kv_transfer_bytes + (prefill_out.kv_transfer_bytes if prefill_out else 0),
        )
        if d is not None:
            load_s = out.kv_transfer_s if prefill_out is not None else 0.0
            timings.first_decode_s = d.prefill_s
            timings.queue_s = max(0.0, d.queued_s - load_s)
            timings.transfer_s = load_s
            first_scheduled = d.first_scheduled_time
            p = prefill_out.metrics if prefill_out is not None else None
            if p is not None and prefill_out is not None:
                store_s = prefill_out.kv_transfer_s
                timings.queue_s += p.queued_s
                timings.prefill_s = max(0.0, p.prefill_s - store_s)
                timings.transfer_s += store_s + max(0.0, handed_at - p.first_token_time)
                first_scheduled = p.first_scheduled_time
            else:  # fallen back or local: the decode worker's own prefill
                timings.prefill_s, timings.first_decode_s = d.prefill_s, 0.0
                timings.queue_s += max(0.0, handed_at - arrival)
            out.metrics = RequestMetrics(arrival, first_scheduled, d.first_token_time, d.finished_time, list(d.itl_s))
        out.disagg = timings


def _closable(outputs: AsyncIterator[RequestOutput]) -> AsyncGenerator[RequestOutput, None]:
    """A worker's `generate` is an async generator (leaving it early aborts the request)."""
    return cast("AsyncGenerator[RequestOutput, None]", outputs)


def prefill_input(inp: EngineInput) -> EngineInput:
    """The prefill worker's input: the same prompt (and cache salt, so the KV keys match), one
    greedy token (dropped), the KV written through before it finishes."""
    return dataclasses.replace(inp, params=SamplingParams(temperature=0.0, max_tokens=1), kv_produce=True)
