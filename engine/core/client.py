"""Clients of one engine core, behind one interface: in-process (the offline LLM) or a spawned
worker process over ZeroMQ (the server).

The worker sends something at least every `core_process.HEARTBEAT_S` while it runs (each step's
outputs, or an idle heartbeat); an MPClient with a `heartbeat_timeout` takes a worker silent for
longer as stalled (stopped, or hung in a step), kills it and reports it dead."""

from __future__ import annotations

import abc
import os
import shutil
import tempfile
import threading
import time

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
    make_event_decoder,
)
from pagedserve.engine.core.process import run_engine_core, to_engine_request
from pagedserve.engine.platform.worker_start import worker_context, worker_environment

LAST_WORDS_S = 0.5  # how long to wait for a dead worker's queued messages


class EngineStartError(RuntimeError):
    """The worker process failed to start; the message says why."""


class EngineDeadError(RuntimeError):
    """The worker process died (or was shut down) while requests were in flight."""


class EngineStalledError(EngineDeadError):
    """The worker sent nothing for longer than its heartbeat timeout; it was killed."""


class EngineCoreClient(abc.ABC):
    info: EngineInfo | None  # None until the worker reports ready

    @abc.abstractmethod
    def add_request(self, request: EngineCoreRequest) -> None: ...

    @abc.abstractmethod
    def abort_requests(self, request_ids: list[str]) -> None: ...

    @abc.abstractmethod
    def set_num_threads(self, num_threads: int) -> None:
        """Torch threads of the engine from its next step on."""

    @abc.abstractmethod
    def get_output(self, timeout: float | None = None) -> EngineCoreOutputs | SleepState | None:
        """The next step's outputs, or the answer to a sleep / wake (None: nothing within
        `timeout`). EngineDeadError if gone."""

    @abc.abstractmethod
    def shutdown(self, timeout: float = 10.0) -> None: ...


class InprocClient(EngineCoreClient):
    """Drives an EngineCore in the calling thread: get_output() runs one step."""

    def __init__(self, core) -> None:
        self.core = core
        self.info = EngineInfo(
            pid=os.getpid(),
            max_model_len=core.max_model_len,
            vocab_size=core.vocab_size,
            num_kv_blocks=core.kv_manager.pool.num_blocks,
            block_size=core.config.block_size,
        )

    def add_request(self, request: EngineCoreRequest) -> None:
        self.core.add_request(to_engine_request(request))

    def abort_requests(self, request_ids: list[str]) -> None:
        self.core.abort_requests(request_ids)

    def set_num_threads(self, num_threads: int) -> None:
        self.core.set_num_threads(num_threads)

    def get_output(self, timeout: float | None = None) -> EngineCoreOutputs:
        outputs = self.core.step() if self.core.has_unfinished_requests() else []
        return EngineCoreOutputs(outputs, self.core.make_stats(), time.monotonic())

    def shutdown(self, timeout: float = 10.0) -> None:
        self.core.shutdown()


class MPClient(EngineCoreClient):
    """Spawns one engine-core process and talks to it over two ipc:// sockets.

    Thread-safety: sends are serialized by one lock and receives by another, and shutdown()
    takes both before it closes the sockets, so it may be called from any thread at any time
    (ZeroMQ sockets must never be used by two threads at once).
    """

    def __init__(self, config: EngineConfig, name: str = "engine-core", heartbeat_timeout: float | None = None) -> None:
        self._ipc_dir = tempfile.mkdtemp(prefix="pagedserve-")
        input_address = f"ipc://{self._ipc_dir}/input"
        output_address = f"ipc://{self._ipc_dir}/output"
        self._context = zmq.Context()
        self._input = self._context.socket(zmq.PUSH)
        self._input.setsockopt(zmq.LINGER, 0)
        # No send high-water mark: with the worker connected a send never blocks, and without
        # it (dead, or exiting) a NOBLOCK send fails at once instead of blocking forever.
        self._input.setsockopt(zmq.SNDHWM, 0)
        self._input.bind(input_address)
        self._output = self._context.socket(zmq.PULL)
        self._output.bind(output_address)
        self._send_lock = threading.Lock()
        self._recv_lock = threading.Lock()
        self._encoder = msgspec.msgpack.Encoder()
        self._decoder = make_event_decoder()
        self._closed = False
        self.heartbeat_timeout = heartbeat_timeout  # None: a silent worker is waited for
        self.last_heard = time.monotonic()  # when the worker last sent anything
        self.info: EngineInfo | None = None
        self.process = worker_context().Process(
            target=run_engine_core,
            args=(config, input_address, output_address, os.getpid(), worker_environment()),
            name=name,
        )
        self.process.start()

    @property
    def pid(self) -> int | None:
        return self.process.pid

    def wait_ready(self, timeout: float) -> EngineInfo:
        """Block until the worker reports ready; EngineStartError if it fails or times out."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            try:
                event = self._recv(timeout=0.2)
            except EngineDeadError as exc:
                raise EngineStartError(str(exc)) from None
            if isinstance(event, EngineInfo):
                self.info = event
                return event
        raise EngineStartError(f"the worker was not ready within {timeout:.0f} s")

    def _recv(self, timeout: float | None):
        frame = self._poll(timeout)
        if frame is None and not self.process.is_alive():
            # A worker that fails sends why before it exits: its last words may have landed
            # between the poll above and its exit.
            frame = self._poll(LAST_WORDS_S)
            if frame is None:
                raise EngineDeadError(f"worker {self.pid} exited (exit code {self.process.exitcode})")
        if frame is None:
            return None
        event = self._decoder.decode(frame)
        if isinstance(event, EngineFailure):
            raise EngineDeadError(f"worker {self.pid} failed: {event.message}")
        return event

    def _poll(self, timeout: float | None) -> bytes | None:
        with self._recv_lock:
            if self._closed:
                raise EngineDeadError("the worker is shut down")
            if self._output.poll(None if timeout is None else int(timeout * 1000)):
                frame = self._output.recv()
                self.last_heard = time.monotonic()
                return frame
            return None

    def add_request(self, request: EngineCoreRequest) -> None:
        self._send(request)

    def abort_requests(self, request_ids: list[str]) -> None:
        if request_ids:
            self._send(AbortRequests(list(request_ids)))

    def set_num_threads(self, num_threads: int) -> None:
        self._send(SetThreads(num_threads))

    def sleep(self) -> None:
        """Ask the worker to sleep; it answers with a SleepState (see get_output)."""
        self._send(Sleep())

    def wake(self) -> None:
        self._send(Wake())

    def _send(self, msg) -> None:
        with self._send_lock:
            if self._closed:
                raise EngineDeadError("the worker is shut down")
            try:
                self._input.send(self._encoder.encode(msg), zmq.NOBLOCK)
            except zmq.Again:
                raise EngineDeadError(f"worker {self.pid} is not connected") from None

    def get_output(self, timeout: float | None = None) -> EngineCoreOutputs | SleepState | None:
        """The next step's outputs, or the answer to a sleep / wake (None: nothing in time)."""
        event = self._recv(timeout)
        if event is None:
            self._check_heartbeat()
        return event if isinstance(event, (EngineCoreOutputs, SleepState)) else None

    def _check_heartbeat(self) -> None:
        """Kill the worker and raise EngineStalledError when it has been silent too long.

        Called only when a poll found nothing: messages that are merely waiting in the socket
        (the front end was slow to read, not the worker to write) always count as heard."""
        silent = time.monotonic() - self.last_heard
        if self.heartbeat_timeout is None or silent <= self.heartbeat_timeout:
            return
        self.process.kill()  # SIGKILL ends a stopped process too; its pid stays ours until joined
        raise EngineStalledError(
            f"worker {self.pid} sent nothing for {silent:.1f} s "
            f"(worker_heartbeat_timeout {self.heartbeat_timeout:g} s): "
            "stalled, killed"
        )

    def shutdown(self, timeout: float = 10.0) -> None:
        """Ask the worker to exit; SIGKILL it after `timeout`. Idempotent."""
        with self._send_lock, self._recv_lock:
            if self._closed:
                return
            if self.process.is_alive():
                try:
                    self._input.send(self._encoder.encode(Shutdown()), zmq.NOBLOCK)
                except zmq.Again:
                    pass  # the worker is already leaving: its input socket is gone
            self._closed = True
        self.process.join(timeout)
        if self.process.is_alive():
            self.process.kill()
            self.process.join(5)
        with self._send_lock, self._recv_lock:
            self._context.destroy(linger=0)
        shutil.rmtree(self._ipc_dir, ignore_errors=True)
