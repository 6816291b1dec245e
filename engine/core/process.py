"""The engine-core worker process: a busy loop around EngineCore.step(), fed over ZeroMQ.

Three threads: the main thread polls inputs, schedules and executes; one thread receives and
decodes inputs; one encodes and sends outputs, so socket work overlaps the model's compute.
The front end binds both sockets; this process connects, sends EngineInfo (or EngineFailure)
first, then one EngineCoreOutputs per step and a stats heartbeat every second when idle.
"""

from __future__ import annotations

import logging
import os
import queue
import signal
import threading
import time
import traceback
from dataclasses import dataclass

import msgspec
import zmq

from pagedserve.engine.config.engine import EngineConfig
from pagedserve.engine.core.messages import (
    AbortRequests,
    EngineCoreOutputs,
    EngineCoreRequest,
    EngineFailure,
    EngineInfo,
    SetThreads,
    Shutdown,
    Sleep,
    SleepState,
    Wake,
    make_input_decoder,
)
from pagedserve.engine.request.request import FinishReason, Request
from pagedserve.engine.scheduler.output import EngineCoreOutput

logger = logging.getLogger(__name__)

HEARTBEAT_S = 1.0
_STOP = object()  # tells the output thread to flush and close


def to_engine_request(msg: EngineCoreRequest) -> Request:
    return Request(
        msg.request_id,
        msg.prompt_token_ids,
        msg.sampling_params,
        arrival_time=msg.arrival_time or time.monotonic(),
        priority=msg.priority,
        cache_salt=msg.cache_salt,
        pooling_params=msg.pooling_params,
        lora=msg.lora,
        kv_produce=msg.kv_produce,
    )


class EngineCoreProc:
    def __init__(self, input_address: str, output_address: str, parent_pid: int) -> None:
        self.parent_pid = parent_pid
        self.inputs: queue.Queue = queue.Queue()
        self.outputs: queue.Queue = queue.Queue()
        self.context = zmq.Context()
        self._input_thread = threading.Thread(
            target=self._recv_inputs, args=(input_address,), name="engine-input", daemon=True
        )
        self._output_thread = threading.Thread(
            target=self._send_outputs, args=(output_address,), name="engine-output", daemon=True
        )
        self._input_thread.start()
        self._output_thread.start()

    # -- socket threads --------------------------------------------------------------------
    def _recv_inputs(self, address: str) -> None:
        sock = self.context.socket(zmq.PULL)
        sock.setsockopt(zmq.LINGER, 0)
        sock.connect(address)
        decoder = make_input_decoder()
        while True:
            try:
                frame = sock.recv()
            except zmq.ContextTerminated:
                sock.close()  # lets close()'s context.term() finish
                return
            try:
                self.inputs.put(decoder.decode(frame))
            except msgspec.ValidationError as exc:
                self.inputs.put(_refused_input(frame, exc))

    def _send_outputs(self, address: str) -> None:
        sock = self.context.socket(zmq.PUSH)
        sock.setsockopt(zmq.LINGER, 5000)
        sock.connect(address)
        encoder = msgspec.msgpack.Encoder()
        while (item := self.outputs.get()) is not _STOP:
            sock.send(encoder.encode(item))
        sock.close()

    def close(self) -> None:
        """Deliver what is queued for the front end before the process exits (os._exit).

        Closing a socket only hands its messages to ZeroMQ's I/O thread; only terminating the
        context waits (up to the output socket's linger) until they are on the wire. Without it
        a failing worker's EngineFailure was lost on a slow machine. term() also wakes the
        input thread's blocking recv, which then closes its socket; it runs on a helper thread
        so that a stuck socket cannot hold the exit.
        """
        self.outputs.put(_STOP)
        self._output_thread.join(timeout=10)
        terminator = threading.Thread(target=self.context.term, name="engine-zmq-term", daemon=True)
        terminator.start()
        terminator.join(timeout=10)

    # -- the busy loop ---------------------------------------------------------------------
    def run(self, core) -> None:
        last_sent = 0.0
        while True:
            idle = not core.has_unfinished_requests()
            if self._drain_inputs(core, block=idle):
                return
            if core.has_unfinished_requests():
                outputs = core.step()
                self.outputs.put(EngineCoreOutputs(outputs, core.make_stats(), time.monotonic()))
                last_sent = time.monotonic()
            elif time.monotonic() - last_sent >= HEARTBEAT_S:
                if self._front_end_gone():
                    logger.warning("the front end is gone; engine core exits")
                    return
                core.check_health()  # a tensor-parallel rank that died while idle ends the worker
                self.outputs.put(EngineCoreOutputs([], core.make_stats(), time.monotonic()))
                last_sent = time.monotonic()

    def _front_end_gone(self) -> bool:
        """Whether the process that started this worker has ended. Its parent is the front end
        when the worker was spawned, and the fork server otherwise (which ends with the front
        end; pagedserve.engine.platform.worker_start), so the front end's pid is asked directly."""
        if os.getppid() == self.parent_pid:
            return False
        try:
            os.kill(self.parent_pid, 0)
        except ProcessLookupError:
            return True
        except PermissionError:  # alive, someone else's: the pid was reused, so ours is gone
            return True
        return False

    def _drain_inputs(self, core, block: bool) -> bool:
        """Apply every pending input; True when asked to shut down."""
        try:
            msg = self.inputs.get(timeout=HEARTBEAT_S) if block else self.inputs.get_nowait()
        except queue.Empty:
            return False
        while True:
            if isinstance(msg, Shutdown):
                return True
            if isinstance(msg, AbortRequests):
                core.abort_requests(msg.request_ids)
            elif isinstance(msg, SetThreads):
                core.set_num_threads(msg.num_threads)
            elif isinstance(msg, (Sleep, Wake)):
                self.outputs.put(_sleep_or_wake(core, isinstance(msg, Sleep)))
            elif isinstance(msg, EngineCoreRequest):
                self._add_request(core, msg)
            elif isinstance(msg, _RefusedInput):
                self._refuse(core, msg.request_id, msg.message)
            try:
                msg = self.inputs.get_nowait()
            except queue.Empty:
                return False

    def _add_request(self, core, msg: EngineCoreRequest) -> None:
        try:
            core.add_request(to_engine_request(msg))
        except ValueError as exc:
            # The front end validates first; if it still gets here, end the request, not the worker.
            self._refuse(core, msg.request_id, str(exc))

    def _refuse(self, core, request_id: str | None, message: str) -> None:
        """Answer a request the worker will not run with an error output (never a silent drop,
        which would leave the front end waiting until its timeout)."""
        logger.warning("refused request %s: %s", request_id, message)
        if request_id is None:
            return  # not a request: nobody waits for an answer
        refusal = EngineCoreOutput(request_id, [], finish_reason=FinishReason.ABORT, error=message)
        self.outputs.put(EngineCoreOutputs([refusal], core.make_stats(), time.monotonic()))


def _sleep_or_wake(core, sleep: bool) -> SleepState:
    """Put the engine to sleep (free weights and KV pool, return the heap to the system) or
    wake it; the answer carries the RSS measured afterwards."""
    import gc

    from pagedserve.engine.platform.process_setup import release_free_memory, resident_bytes

    started = time.monotonic()
    error = None
    try:
        if sleep:
            core.sleep()
        else:
            core.wake()
    except (RuntimeError, OSError, ValueError) as exc:  # busy, or the weights failed to load
        error = f"{type(exc).__name__}: {exc}"
        logger.warning("%s failed: %s", "sleep" if sleep else "wake", error)
    gc.collect()
    release_free_memory()
    return SleepState(core.sleeping, resident_bytes(), time.monotonic() - started, error)


@dataclass(frozen=True, slots=True)
class _RefusedInput:
    """An input message the worker's decoder refused; `request_id` when it was a request."""

    request_id: str | None
    message: str


def _refused_input(frame: bytes, exc: msgspec.ValidationError) -> _RefusedInput:
    try:
        raw = msgspec.msgpack.decode(frame)
    except msgspec.DecodeError:
        raw = None
    request_id = raw.get("request_id") if isinstance(raw, dict) else None
    return _RefusedInput(request_id if isinstance(request_id, str) else None, f"invalid request: {exc}")


def run_engine_core(
    config: EngineConfig, input_address: str, output_address: str, parent_pid: int, environ: dict[str, str]
) -> None:
    """Process entry point (multiprocessing: pagedserve.engine.platform.worker_start)."""
    from pagedserve.engine.platform.process_setup import die_with_parent  # imports torch, which the worker needs anyway
    from pagedserve.engine.platform.worker_start import apply_environment

    apply_environment(environ)  # the starting process's, as a spawned worker would have it
    die_with_parent()  # no orphaned workers; not Linux: the parent-pid check in the loop
    if config.visible_devices is not None:  # before CUDA is first touched (TP ranks inherit it)
        os.environ["CUDA_VISIBLE_DEVICES"] = config.visible_devices
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C goes to the front end, which stops us
    # SIGTERM to the whole group (systemd's KillMode=control-group, `timeout`, a process-group
    # kill) is the front end's to handle too: it drains, then stops us; if it dies we die
    # with it (die_with_parent).
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    logging.basicConfig(level=logging.INFO, format=f"[worker {os.getpid()}] %(levelname)s %(name)s: %(message)s")
    proc = EngineCoreProc(input_address, output_address, parent_pid)
    exit_code = 0
    try:
        from pagedserve.engine.core.engine_core import EngineCore  # heavy: torch and the model code
        from pagedserve.engine.platform.process_setup import configure_engine_process

        configure_engine_process(config)  # this process is the engine's: threads, seed, malloc
        start = time.perf_counter()
        logger.info("loading %s (%s threads)", config.model, config.num_threads or "default")
        core = EngineCore(config)
        logger.info(
            "ready: model loaded in %.1f s, %d KV blocks", time.perf_counter() - start, core.kv_manager.pool.num_blocks
        )
        proc.outputs.put(
            EngineInfo(
                pid=os.getpid(),
                max_model_len=core.max_model_len,
                vocab_size=core.vocab_size,
                num_kv_blocks=core.kv_manager.pool.num_blocks,
                block_size=config.block_size,
            )
        )
        proc.run(core)
        core.shutdown()
    except Exception as exc:  # noqa: BLE001 -- report why, then exit non-zero: the front end fails in-flight requests
        logger.error("engine core failed:\n%s", traceback.format_exc())
        proc.outputs.put(EngineFailure(f"{type(exc).__name__}: {exc}"))
        exit_code = 1
    finally:
        proc.close()
    os._exit(exit_code)  # skip interpreter teardown of torch/zmq threads
