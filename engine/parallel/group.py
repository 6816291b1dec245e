"""One rank's place in a tensor-parallel group: its process groups and the collectives the model
and the step loop use.

Two torch.distributed process groups join the ranks, made directly (no `init_process_group`, so
nothing process-wide: several groups can live in one process, e.g. a test's engines):
- compute: the model's all-reduces and the logits gather; gloo on CPU, NCCL on CUDA (each rank
  on its own device). A collective waits at most `COMPUTE_TIMEOUT` for a silent rank; a rank
  that died is noticed at once (its sockets close) and the collective raises.
- control: rank 0's messages to the others (pagedserve.engine.parallel.messages), always gloo over CPU
  tensors. The other ranks wait on it between steps, for as long as the worker stays idle (up
  to `IDLE_TIMEOUT`, a year: past it a rank exits, and rank 0's health check restarts the worker).
Both rendezvous through a TCPStore that rank 0 opens on a free loopback port.
"""

from __future__ import annotations

from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist

from pagedserve.engine.parallel.messages import Message, decode, encode

COMPUTE_TIMEOUT = timedelta(seconds=300)  # a rank this late inside a step is stuck
IDLE_TIMEOUT = timedelta(days=365)  # the other ranks wait this long for rank 0's next step
LOOPBACK = "127.0.0.1"  # every rank runs on this machine


def rank_device(device: str | torch.device, rank: int) -> torch.device:
    """Rank `rank`'s device: the CPU for every rank, or the rank-th CUDA device from `device`'s."""
    device = torch.device(device)
    if device.type != "cuda":
        return device
    return torch.device("cuda", (device.index or 0) + rank)


def _gloo(store: dist.Store, rank: int, size: int, timeout: timedelta) -> Any:
    # init_process_group builds its gloo groups the same way; the device pins them to loopback.
    options = dist.ProcessGroupGloo._Options()  # type: ignore[attr-defined]  # private, missing from torch's stubs
    options._timeout = timeout
    options._devices = [dist.ProcessGroupGloo.create_device(hostname=LOOPBACK)]
    return dist.ProcessGroupGloo(store, rank, size, options)


def _nccl(store: dist.Store, rank: int, size: int, timeout: timedelta) -> Any:
    options = dist.ProcessGroupNCCL.Options()
    options._timeout = timeout
    return dist.ProcessGroupNCCL(store, rank, size, options)


class TensorParallelGroup:
    """Rank `rank` of `size`, on `device`. Built before the model (which keeps it for its
    collectives), joined to the others by `connect` once every rank has loaded its shard."""

    def __init__(self, rank: int, size: int, device: torch.device) -> None:
        if not 0 <= rank < size:
            raise ValueError(f"rank {rank} is not in a group of {size}")
        self.rank, self.size, self.device = rank, size, device
        # c10d backends (ProcessGroupGloo / ProcessGroupNCCL), used directly as init_process_group would
        self._compute: Any = None
        self._control: Any = None

    def connect(self, store: dist.Store) -> None:
        """Join the other ranks (each calls this with the same store); blocks until all have."""
        if self.device.type == "cuda":
            torch.cuda.set_device(self.device)
            self._compute = _nccl(dist.PrefixStore("compute", store), self.rank, self.size, COMPUTE_TIMEOUT)
        else:
            self._compute = _gloo(dist.PrefixStore("compute", store), self.rank, self.size, COMPUTE_TIMEOUT)
        self._control = _gloo(dist.PrefixStore("control", store), self.rank, self.size, IDLE_TIMEOUT)

    # -- the model's collectives ---------------------------------------------------------
    def all_reduce(self, tensor: torch.Tensor) -> torch.Tensor:
        """Sum `tensor` over the ranks, in place; returns it."""
        self._compute.allreduce([tensor]).wait()
        return tensor

    def gather_vocab(self, logits: torch.Tensor) -> torch.Tensor | None:
        """Each rank's `[N, vocab / size]` slice -> `[N, vocab]` on rank 0 (None elsewhere)."""
        logits = logits.contiguous()
        options = dist.GatherOptions()
        options.rootRank = 0
        if self.rank != 0:
            self._compute.gather([], [logits], options).wait()
            return None
        parts = [torch.empty_like(logits) for _ in range(self.size)]
        self._compute.gather([parts], [logits], options).wait()
        return torch.cat(parts, dim=-1)

    # -- rank 0's messages ---------------------------------------------------------------
    def send(self, message: Message) -> None:
        """Rank 0: broadcast `message` to the other ranks."""
        payload = encode(message)
        self._broadcast(torch.tensor([payload.numel()], dtype=torch.int64))
        self._broadcast(payload)

    def receive(self) -> Message:
        """Ranks > 0: wait for rank 0's next message (its tensors land on this rank's device)."""
        length = torch.zeros(1, dtype=torch.int64)
        self._broadcast(length)
        payload = torch.empty(int(length.item()), dtype=torch.uint8)
        self._broadcast(payload)
        return decode(payload, self.device)

    def _broadcast(self, tensor: torch.Tensor) -> None:
        options = dist.BroadcastOptions()
        options.rootRank = 0
        self._control.broadcast([tensor], options).wait()
