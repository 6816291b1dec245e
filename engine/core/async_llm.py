"""The front-end half of one engine worker, for asyncio servers.

An AsyncLLM owns one engine-core process (MPClient). A thread of its own receives each step's
outputs, detokenizes them (OutputProcessor) and hands snapshots to the event loop, so neither
socket reads nor detokenization run on the loop. Each request is an async iterator of
cumulative RequestOutputs; leaving the iterator early aborts the request in the engine.
"""

from __future__ import annotations

import asyncio
import logging
import threading
import time
from collections.abc import AsyncGenerator, Callable
from dataclasses import dataclass, field, replace

from pagedserve.engine.config.engine import EngineConfig
from pagedserve.engine.core.client import EngineDeadError, EngineStartError, MPClient
from pagedserve.engine.core.messages import EngineInfo, SleepState
from pagedserve.engine.core.output_processor import OutputProcessor
from pagedserve.engine.request.inputs import EngineInput, InputLimits
from pagedserve.engine.request.outputs import RequestMetrics, RequestOutput
from pagedserve.engine.scheduler.stats import SchedulerStats

__all__ = ["AsyncLLM", "EngineDeadError", "EngineInfo", "EngineStartError", "SchedulerStats"]

logger = logging.getLogger(__name__)

POLL_S = 0.2  # how often the output thread checks that the worker is alive


@dataclass(slots=True)
class _Timing:
    arrival_time: float
    first_scheduled_time: float | None = None
    first_token_time: float | None = None
    last_token_time: float | None = None
    itl_s: list[float] = field(default_factory=list)

    def on_tokens(self, now: float) -> None:
        if self.last_token_time is None:
            self.first_token_time = now
        else:
            self.itl_s.append(now - self.last_token_time)
        self.last_token_time = now

    def as_metrics(self, finished_time: float) -> RequestMetrics:
        """A request never scheduled counts as scheduled on arrival; one that produced no token
        (aborted, refused) as having its first token when it finished."""
        scheduled = self.first_scheduled_time if self.first_scheduled_time is not None else self.arrival_time
        first_token = self.first_token_time if self.first_token_time is not None else finished_time
        return RequestMetrics(self.arrival_time, scheduled, first_token, finished_time, list(self.itl_s))


def _snapshot(out: RequestOutput) -> RequestOutput:
    """A copy the event loop can hold while the output thread keeps updating the original."""
    outputs = [
        replace(c, token_ids=list(c.token_ids), logprobs=None if c.logprobs is None else list(c.logprobs))
        for c in out.outputs
    ]
    return replace(out, outputs=outputs)  # metrics are set once, on the finished output


class AsyncLLM:
    def __init__(
        self,
        config: EngineConfig,
        tokenizer,
        *,
        name: str = "worker",
        on_dead: Callable[[AsyncLLM], None] | None = None,
        heartbeat_timeout: float | None = None,
    ) -> None:
        self.config = config
        self.name = name
        self.on_dead = on_dead
        # A worker silent this long is stalled: killed, its requests failed, on_dead called.
        self.heartbeat_timeout = heartbeat_timeout
        self.info: EngineInfo | None = None
        self.stats = SchedulerStats()
        self.dead_reason: str | None = None
        self.num_threads = config.num_threads  # torch threads the worker uses (None: its default)
        self._processor = OutputProcessor(tokenizer)
        self._lock = threading.Lock()  # guards the processor, timings and parents
        self._queues: dict[str, asyncio.Queue] = {}  # request id -> its consumer (loop side)
        self._timings: dict[str, _Timing] = {}
        self._parents: dict[str, str] = {}  # engine (child) request id -> request id
        self._client: MPClient | None = None
        self._thread: threading.Thread | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self._closing = False
        self.sleeping = False  # asleep: weights and KV pool freed, no requests routed here
        self._sleep_answer: asyncio.Future | None = None  # the sleep / wake waiting for its answer

    # -- state -----------------------------------------------------------------------------
    @property
    def pid(self) -> int | None:
        return self._client.pid if self._client else None

    @property
    def is_dead(self) -> bool:
        return self.dead_reason is not None

    @property
    def is_ready(self) -> bool:
        return self.info is not None and not self.is_dead and not self._closing and not self.sleeping

    @property
    def num_unfinished(self) -> int:
        return len(self._queues)

    @property
    def _worker(self) -> MPClient:
        if self._client is None:
            raise EngineDeadError(f"{self.name} is not started")
        return self._client

    @property
    def _owner_loop(self) -> asyncio.AbstractEventLoop:
        """The event loop that started the worker: its queues and futures live there."""
        if self._loop is None:
            raise EngineDeadError(f"{self.name} is not started")
        return self._loop

    # -- life cycle ------------------------------------------------------------------------
    async def start(self, timeout: float = 300.0) -> EngineInfo:
        """Spawn the worker and wait until its engine is built (EngineStartError otherwise)."""
        if self._client is not None:
            raise RuntimeError(f"{self.name} was already started")
        self._loop = asyncio.get_running_loop()
        # Spawned from the loop's thread, not an executor thread: the worker's parent-death
        # signal fires when the thread that started it exits.
        self._client = MPClient(self.config, self.name, heartbeat_timeout=self.heartbeat_timeout)
        try:
            self.info = await self._loop.run_in_executor(None, self._client.wait_ready, timeout)
        except BaseException as exc:
            self.dead_reason = str(exc)
            await self._loop.run_in_executor(None, self._client.shutdown, 2.0)
            raise
        self._thread = threading.Thread(target=self._output_loop, name=f"{self.name}-outputs", daemon=True)
        self._thread.start()
        return self.info

    async def shutdown(self, timeout: float = 10.0) -> None:
        """Stop the worker (gracefully, then SIGKILL); in-flight requests fail. Idempotent."""
        if self._closing:
            return
        self._closing = True
        loop = asyncio.get_running_loop()
        if self._thread is not None:
            await loop.run_in_executor(None, self._thread.join)
        if self._client is not None:
            await loop.run_in_executor(None, self._client.shutdown, timeout)
        self._fail_all(EngineDeadError(f"{self.name} was shut down"))

    async def sleep(self, timeout: float = 60.0) -> SleepState:
        """Free the worker's weights and KV pool (the process stays); only when it has no
        request (RuntimeError otherwise). Routing skips it until `wake`."""
        if self.num_unfinished:
            raise RuntimeError(f"{self.name} has {self.num_unfinished} requests in flight")
        self.sleeping = True  # no new request from here on
        try:
            return await self._sleep_or_wake(self._worker.sleep, timeout)
        except BaseException:
            self.sleeping = False
            raise

    async def wake(self, timeout: float = 300.0) -> SleepState:
        """Load the weights and KV pool again; routing resumes once the worker says so."""
        answer = await self._sleep_or_wake(self._worker.wake, timeout)
        self.sleeping = answer.sleeping
        return answer

    async def _sleep_or_wake(self, send: Callable[[], None], timeout: float) -> SleepState:
        if self._client is None or self.is_dead or self._closing:
            raise EngineDeadError(f"{self.name} is not running")
        if self._sleep_answer is not None:
            raise RuntimeError(f"{self.name} is already going to sleep or waking up")
        self._sleep_answer = self._owner_loop.create_future()
        # The worker sends no heartbeat while it loads or frees its weights (seconds to
        # minutes for a large model): its silence is bounded by `timeout` instead.
        heartbeat = self._client.heartbeat_timeout
        if heartbeat is not None:
            self._client.heartbeat_timeout = max(heartbeat, timeout)
        try:
            send()
            answer = await asyncio.wait_for(self._sleep_answer, timeout)
        finally:
            self._sleep_answer = None
            self._client.heartbeat_timeout = heartbeat
        if answer.error is not None:
            raise RuntimeError(f"{self.name}: {answer.error}")
        return answer

    def _on_sleep_state(self, answer: SleepState) -> None:
        if self._sleep_answer is not None and not self._sleep_answer.done():
            self._sleep_answer.set_result(answer)

    # -- requests --------------------------------------------------------------------------
    @property
    def limits(self) -> InputLimits:
        """What this worker's engine accepts, with the server's rule that max_tokens must fit."""
        if self.info is None:
            raise RuntimeError(f"{self.name} is not started")
        return InputLimits(self.info.max_model_len, self.info.vocab_size)

    async def generate(
        self,
        request_id: str,
        inp: EngineInput,
        *,
        priority: int = 0,
        arrival_time: float | None = None,
    ) -> AsyncGenerator[RequestOutput, None]:
        """Generate for a prepared input; cumulative outputs until finished. `inp` was checked
        where the request entered (pagedserve.engine.request.inputs.validate_input against
        `limits`, by the front end's prepare step): nothing is checked again on the way down."""
        if not self.is_ready:
            raise EngineDeadError(f"{self.name} is not running: {self.dead_reason or 'shutting down'}")
        arrival = arrival_time if arrival_time is not None else time.monotonic()
        queue: asyncio.Queue = asyncio.Queue()
        with self._lock:
            requests = self._processor.add_request(request_id, inp, priority=priority, arrival_time=arrival)
            self._timings[request_id] = _Timing(arrival)
            for request in requests:
                self._parents[request.request_id] = request_id
        self._queues[request_id] = queue
        finished = False
        try:
            if self.is_dead:  # died between the check above and the registration
                raise EngineDeadError(f"{self.name} died: {self.dead_reason}")
            for request in requests:
                self._worker.add_request(request)
            while True:
                item = await queue.get()
                if isinstance(item, BaseException):
                    finished = isinstance(item, EngineDeadError)  # else interrupted: abort it
                    raise item
                finished = item.finished
                yield item
                if finished:
                    return
        finally:
            self._queues.pop(request_id, None)
            if not finished:
                self._abort_now(request_id)
            with self._lock:
                self._timings.pop(request_id, None)

    async def abort(self, request_id: str) -> None:
        """Abort a request; its iterator ends with a finished output (finish_reason ABORT)."""
        with self._lock:
            final = self._processor.mark_aborted(request_id)
            final = None if final is None else _snapshot(final)
        self._abort_now(request_id)
        queue = self._queues.get(request_id)
        if queue is not None and final is not None:
            queue.put_nowait(final)

    def set_num_threads(self, num_threads: int) -> None:
        """Resize the worker's torch thread pool (from its next step on)."""
        if num_threads < 1:
            raise ValueError(f"num_threads must be >= 1, got {num_threads}")
        if not self.is_ready:
            raise EngineDeadError(f"{self.name} is not running")
        self._worker.set_num_threads(num_threads)
        self.num_threads = num_threads

    def interrupt(self, request_id: str, error: BaseException) -> None:
        """Make the request's iterator raise `error` at its next step; leaving it aborts the
        request in the engine (for a caller that gives up: a deadline, a client gone)."""
        queue = self._queues.get(request_id)
        if queue is not None:
            queue.put_nowait(error)

    def _abort_now(self, request_id: str) -> None:
        with self._lock:
            child_ids = self._processor.abort_request(request_id)
            for child_id in child_ids:
                self._parents.pop(child_id, None)
        if child_ids and not self.is_dead and not self._closing:
            try:
                self._worker.abort_requests(child_ids)
            except EngineDeadError:
                pass  # the worker is gone, and its blocks with it

    # -- the output thread -----------------------------------------------------------------
    def _output_loop(self) -> None:
        while not self._closing:
            try:
                batch = self._worker.get_output(timeout=POLL_S)
            except EngineDeadError as exc:
                if not self._closing:
                    self._owner_loop.call_soon_threadsafe(self._on_death, str(exc))
                return
            except Exception:  # a bug here must not silently stall every request
                logger.exception("%s: output thread failed", self.name)
                self._owner_loop.call_soon_threadsafe(self._on_death, "the front end's output thread failed")
                return
            if batch is None:
                continue
            if isinstance(batch, SleepState):
                self._owner_loop.call_soon_threadsafe(self._on_sleep_state, batch)
                continue
            self.stats = batch.stats
            if batch.outputs:
                self._process(batch.outputs)

    def _process(self, outputs) -> None:
        now = time.monotonic()
        deliveries = []
        with self._lock:
            for eco in outputs:
                parent = self._parents.get(eco.request_id)
                timing = self._timings.get(parent) if parent else None
                if timing is not None and eco.first_scheduled_time is not None and timing.first_scheduled_time is None:
                    timing.first_scheduled_time = eco.first_scheduled_time
                if eco.finished:
                    self._parents.pop(eco.request_id, None)
            changed, to_abort = self._processor.process_outputs(outputs)
            for out in changed:
                timing = self._timings.get(out.request_id)
                if timing is not None:
                    timing.on_tokens(now)
                    if out.finished:
                        out.metrics = timing.as_metrics(now)
                deliveries.append(_snapshot(out))
            for child_id in to_abort:
                self._parents.pop(child_id, None)
        if to_abort:  # stop strings end requests the engine would otherwise continue
            try:
                self._worker.abort_requests(to_abort)
            except EngineDeadError:
                pass
        if deliveries:
            self._owner_loop.call_soon_threadsafe(self._deliver, deliveries)

    # -- loop side -------------------------------------------------------------------------
    def _deliver(self, deliveries: list[RequestOutput]) -> None:
        for out in deliveries:
            queue = self._queues.get(out.request_id)
            if queue is not None:
                queue.put_nowait(out)

    def _on_death(self, reason: str) -> None:
        if self.is_dead:
            return
        self.dead_reason = reason
        # Stopped on purpose (scale down, unregister, shutdown): not an error.
        logger.log(
            logging.INFO if self._closing else logging.ERROR,
            "%s %s: %s",
            self.name,
            "stopped" if self._closing else "died",
            reason,
        )
        self._fail_all(EngineDeadError(f"{self.name} died: {reason}"))
        if self._sleep_answer is not None and not self._sleep_answer.done():
            self._sleep_answer.set_exception(EngineDeadError(f"{self.name} died: {reason}"))
        if self.on_dead is not None:
            self.on_dead(self)

    def _fail_all(self, error: EngineDeadError) -> None:
        for queue in self._queues.values():
            queue.put_nowait(error)
        with self._lock:
            for request_id in list(self._queues):
                self._processor.abort_request(request_id)
            self._parents.clear()
            self._timings.clear()
        if self.dead_reason is None:
            self.dead_reason = str(error)
