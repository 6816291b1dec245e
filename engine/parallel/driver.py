"""Rank 0 of a tensor-parallel model: the process that runs the engine core (a worker process,
or an offline `LLM`'s) spawns ranks 1..N-1, holds its own shard, and drives the others.

`TensorParallelModel` stands where the model runner keeps its model: calling it sends the
step's flattened inputs to the other ranks (one message) and runs rank 0's share of the forward
pass; `compute_logits` sends the rows to sample (one message) and returns the whole vocabulary's
logits, gathered. Only rank 0 samples.

Failure is loud and final: a rank that dies (or any error inside a step, which leaves the ranks
out of step) makes this and every later call raise `TensorParallelError`, naming the rank and
how it ended. In a server worker that error ends the worker process, and the supervisor starts
the whole group again; an offline `LLM` must be made anew.
"""

from __future__ import annotations

import contextlib
import multiprocessing
import os
import signal
import time
import weakref
from collections.abc import Iterator, Sequence
from multiprocessing.process import BaseProcess
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from pagedserve.engine.attention.kv_dtype import parse_kv_cache_dtype
from pagedserve.engine.config.engine import EngineConfig
from pagedserve.engine.model.kv_pool_size import kv_pool_size
from pagedserve.engine.model.loader import read_config
from pagedserve.engine.model.quant_spec import QuantMethod, QuantSpec
from pagedserve.engine.model.registry import check_tensor_parallel_support, parse_config
from pagedserve.engine.model.sharding import shard_spec
from pagedserve.engine.parallel.group import LOOPBACK, TensorParallelGroup, rank_device
from pagedserve.engine.parallel.messages import Kind, Message, forward_message
from pagedserve.engine.parallel.rank_worker import STORE_TIMEOUT, RankArgs, error_key, load_rank, ready_key, run_rank
from pagedserve.engine.platform.process_setup import rank_threads

RANK_START_TIMEOUT_S = STORE_TIMEOUT.total_seconds()
STOP_WAIT_S = 5.0  # how long a stopped rank may take to exit before it is killed


class TensorParallelError(RuntimeError):
    """The tensor-parallel group broke (a rank died, or a step failed part-way)."""


class TensorParallelModel:
    """Rank 0's shard plus the other ranks' processes. Reads through to the shard's attributes
    (`spec`: the whole model's sizes, `rank_spec`: this rank's)."""

    def __init__(
        self, config: EngineConfig, model_dir: str | Path, backend, max_model_len: int, quant: QuantSpec | None = None
    ) -> None:
        size = config.tensor_parallel_size
        if quant is not None and quant.method is not QuantMethod.NONE:
            raise ValueError(
                f"a quantized model ({quant.method.value}) cannot run with tensor_parallel_size={size}: "
                "tensor parallelism shards full-precision weights only"
            )
        spec = parse_config(read_config(model_dir))
        check_tensor_parallel_support(spec, size)
        rank_spec = shard_spec(spec, size)  # refuses sizes that do not divide
        _, num_blocks = kv_pool_size(config, rank_spec, parse_kv_cache_dtype(config.kv_cache_dtype))
        self.size = size
        self.group = TensorParallelGroup(0, size, rank_device(config.device, 0))
        self._store = dist.TCPStore(LOOPBACK, 0, size, True, wait_for_workers=False, timeout=STORE_TIMEOUT)
        context = multiprocessing.get_context("spawn")
        self.ranks = [
            context.Process(
                target=run_rank,
                name=f"tp-rank-{rank}",
                daemon=True,
                args=(
                    RankArgs(
                        rank,
                        config,
                        str(model_dir),
                        max_model_len,
                        num_blocks,
                        torch.get_num_threads(),
                        self._store.port,
                        os.getpid(),
                    ),
                ),
            )
            for rank in range(1, size)
        ]
        self._failure: str | None = None
        self._closed = False
        # Dropped without close(): the ranks are killed rather than left waiting.
        self._finalizer = weakref.finalize(self, _kill, list(self.ranks))
        try:
            for process in self.ranks:
                process.start()
            self.model = load_rank(config, str(model_dir), max_model_len, self.group, backend)
            self._wait_for_ranks()
            self.group.connect(self._store)
        except BaseException:
            self._failure = "the group did not start"
            self.close()
            raise

    def __getattr__(self, name: str) -> Any:
        model = self.__dict__.get("model")
        if model is None:
            raise AttributeError(name)
        return getattr(model, name)

    @property
    def pids(self) -> list[int]:
        """The process ids of ranks 1..N-1."""
        return [p.pid for p in self.ranks if p.pid is not None]

    # -- the model's interface -----------------------------------------------------------
    def __call__(
        self, input_ids: torch.Tensor, positions: torch.Tensor, kv_caches: list[torch.Tensor], meta, lora=None
    ) -> torch.Tensor:
        if lora is not None:
            raise ValueError(lora_refusal(self.size))
        with self._step("a forward pass"):
            self.group.send(forward_message(input_ids, positions, meta))
            return self.model(input_ids, positions, kv_caches, meta)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor | None:
        with self._step("the logits"):
            self.group.send(Message(Kind.LOGITS, tensors={"hidden": hidden}))
            return self.model.compute_logits(hidden)

    def set_num_threads(self, num_threads: int) -> None:
        """Share `num_threads` among the ranks (rank_threads each), from the next step on."""
        share = rank_threads(num_threads, self.size)
        torch.set_num_threads(share)
        if self._failure is None:
            with self._step("the thread count"):
                self.group.send(Message(Kind.THREADS, {"threads": share}))

    # -- health and shutdown -------------------------------------------------------------
    def check_health(self) -> None:
        """TensorParallelError if the group broke or a rank is gone (cheap: no collective)."""
        if self._failure is None and any(not p.is_alive() for p in self.ranks):
            self._failure = self._describe_ranks()
        if self._failure is not None:
            raise TensorParallelError(f"tensor-parallel group failed: {self._failure}")

    @contextlib.contextmanager
    def _step(self, what: str) -> Iterator[None]:
        self.check_health()
        try:
            yield
        except Exception as exc:
            # A rank died, or rank 0 failed part-way: either way the ranks are out of step.
            ended = self._describe_ranks(wait=1.0)
            first_line = str(exc).strip().splitlines()[0] if str(exc).strip() else ""
            self._failure = f"{what} failed: {ended}" if ended else f"{what} raised {type(exc).__name__}: {first_line}"
            raise TensorParallelError(f"tensor-parallel group failed: {self._failure}") from exc

    def _describe_ranks(self, wait: float = 0.0) -> str:
        """Which ranks ended and how ('' when none did), waiting up to `wait` s for a dying one."""
        deadline = time.monotonic() + wait
        for process in self.ranks:
            process.join(max(0.0, deadline - time.monotonic()))
        return "; ".join(
            f"rank {rank} (pid {p.pid}) {_how_it_ended(p.exitcode)}"
            for rank, p in enumerate(self.ranks, start=1)
            if p.exitcode is not None
        )

    def _wait_for_ranks(self) -> None:
        """Block until every other rank has loaded its shard; RuntimeError naming the first
        that failed (its own error message, or how its process ended)."""
        deadline = time.monotonic() + RANK_START_TIMEOUT_S
        pending = dict(enumerate(self.ranks, start=1))
        while pending:
            for rank, process in list(pending.items()):
                if self._store.check([error_key(rank)]):
                    message = self._store.get(error_key(rank)).decode(errors="replace")
                    raise RuntimeError(f"tensor-parallel rank {rank} failed to load its shard: {message}")
                if self._store.check([ready_key(rank)]):
                    del pending[rank]
                elif not process.is_alive():
                    raise RuntimeError(
                        f"tensor-parallel rank {rank} (pid {process.pid}) "
                        f"{_how_it_ended(process.exitcode)} while loading its shard"
                    )
            if pending and time.monotonic() > deadline:
                raise RuntimeError(
                    f"tensor-parallel ranks {sorted(pending)} did not load their shards "
                    f"within {RANK_START_TIMEOUT_S:.0f} s"
                )
            time.sleep(0.05)

    def close(self) -> None:
        """Stop the other ranks (asked, then killed after STOP_WAIT_S). Idempotent."""
        if self._closed:
            return
        self._closed = True
        if self._failure is None:
            with contextlib.suppress(Exception):  # a rank already gone: killed below
                self.group.send(Message(Kind.STOP))
        deadline = time.monotonic() + (STOP_WAIT_S if self._failure is None else 0.0)
        for process in self.ranks:
            process.join(max(0.0, deadline - time.monotonic()))
        self._finalizer()


def lora_refusal(size: int) -> str:
    return f"lora: LoRA adapters are not supported with tensor_parallel_size={size}"


def _how_it_ended(exitcode: int | None) -> str:
    if exitcode is None:
        return "is alive"
    if exitcode < 0:
        try:
            return f"was killed by {signal.Signals(-exitcode).name}"
        except ValueError:
            return f"was killed by signal {-exitcode}"
    return f"exited with code {exitcode}"


def _kill(processes: Sequence[BaseProcess]) -> None:
    for process in processes:
        if process.pid is None:  # never started
            continue
        if process.is_alive():
            process.kill()
        process.join(1.0)
