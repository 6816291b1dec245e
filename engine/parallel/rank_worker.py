"""A tensor-parallel rank other than 0: a process rank 0 spawns, which loads its shard, then runs
whatever rank 0 broadcasts (pagedserve.engine.parallel.messages) until told to stop or until the group breaks.

It never outlives rank 0: Linux SIGKILLs it when the thread that spawned it ends
(PR_SET_PDEATHSIG), a watchdog thread exits it when its parent process is gone, and a dead rank 0
closes its sockets, which ends the collective it waits in. On any failure it exits non-zero.
"""

from __future__ import annotations

import logging
import os
import signal
import threading
import time
import traceback
from dataclasses import dataclass
from datetime import timedelta

import torch
import torch.distributed as dist

from pagedserve.engine.attention.kv_dtype import parse_kv_cache_dtype
from pagedserve.engine.attention.selector import select_backend
from pagedserve.engine.config.engine import EngineConfig
from pagedserve.engine.model.causal_lm import CausalLM
from pagedserve.engine.model.loader import allocate_kv_caches, load_model, select_fused_ops
from pagedserve.engine.parallel.group import LOOPBACK, TensorParallelGroup, rank_device
from pagedserve.engine.parallel.messages import Kind, read_forward
from pagedserve.engine.platform.process_setup import die_with_parent, tune_glibc_malloc

logger = logging.getLogger(__name__)

STORE_TIMEOUT = timedelta(seconds=600)  # loading a shard and joining the group take at most this


def ready_key(rank: int) -> str:
    return f"ready/{rank}"


def error_key(rank: int) -> str:
    return f"error/{rank}"


@dataclass(frozen=True, slots=True)
class RankArgs:
    """What rank 0 gives a rank it spawns."""

    rank: int
    config: EngineConfig
    model_dir: str
    max_model_len: int
    num_blocks: int  # the KV pool's blocks: the same on every rank
    num_threads: int  # torch threads of this rank
    store_port: int  # rank 0's TCPStore on loopback
    parent_pid: int


def load_rank(
    config: EngineConfig, model_dir: str, max_model_len: int, group: TensorParallelGroup, backend=None
) -> CausalLM:
    """Rank `group.rank`'s shard of the model, read from `model_dir` (rank 0 passes its runner's
    attention backend; the other ranks make their own)."""
    if backend is None:
        backend = select_backend(group.device, config.attention_backend, parse_kv_cache_dtype(config.kv_cache_dtype))
    return load_model(
        model_dir,
        config.torch_dtype,
        group.device,
        backend,
        max_model_len=max_model_len,
        fused_ops=select_fused_ops(group.device, config.torch_dtype),
        tp=group,
    )


def run_rank(args: RankArgs) -> None:
    """Process entry point (multiprocessing, spawn)."""
    die_with_parent()
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C is the front end's to handle
    # SIGTERM to the whole group (systemd's KillMode=control-group, `timeout`, a process-group
    # kill) is the front end's to handle too: it drains, then stops us; if it dies we die
    # with it (die_with_parent).
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    threading.Thread(target=_watch_parent, args=(args.parent_pid,), name="tp-parent-watch", daemon=True).start()
    config, rank = args.config, args.rank
    logging.basicConfig(
        level=logging.INFO, format=f"[tp rank {rank} {os.getpid()}] %(levelname)s %(name)s: %(message)s"
    )
    store = dist.TCPStore(LOOPBACK, args.store_port, config.tensor_parallel_size, False, timeout=STORE_TIMEOUT)
    group = TensorParallelGroup(rank, config.tensor_parallel_size, rank_device(config.device, rank))
    try:
        torch.set_num_threads(args.num_threads)
        if group.device.type == "cpu":
            tune_glibc_malloc()
        model = load_rank(config, args.model_dir, args.max_model_len, group)
        kv_caches = allocate_kv_caches(
            model.rank_spec,
            args.num_blocks,
            config.block_size,
            config.torch_dtype,
            group.device,
            parse_kv_cache_dtype(config.kv_cache_dtype),
        )
    except Exception as exc:  # noqa: BLE001 -- rank 0 reports it and fails its start
        logger.error("loading failed:\n%s", traceback.format_exc())
        store.set(error_key(rank), f"{type(exc).__name__}: {exc}")
        os._exit(1)
    store.set(ready_key(rank), str(os.getpid()))
    try:
        group.connect(store)
        serve(model, kv_caches, group)
    except Exception:  # noqa: BLE001 -- rank 0 or a peer is gone: the group cannot go on
        logger.error("the tensor-parallel group failed; this rank exits:\n%s", traceback.format_exc())
        os._exit(1)
    os._exit(0)  # skip interpreter teardown of torch's threads


@torch.inference_mode()
def serve(model: CausalLM, kv_caches: list[torch.Tensor], group: TensorParallelGroup) -> None:
    """Run rank 0's messages until STOP: each FORWARD is this rank's share of the step (its
    collectives meet rank 0's), each LOGITS its slice of the vocabulary for the gather."""
    while True:
        message = group.receive()
        if message.kind is Kind.FORWARD:
            input_ids, positions, meta = read_forward(message)
            model(input_ids, positions, kv_caches, meta)
        elif message.kind is Kind.LOGITS:
            model.compute_logits(message.tensors["hidden"])
        elif message.kind is Kind.THREADS:
            torch.set_num_threads(int(message.fields["threads"]))
        elif message.kind is Kind.STOP:
            return


def _watch_parent(parent_pid: int) -> None:
    while os.getppid() == parent_pid:
        time.sleep(1.0)
    os._exit(1)  # rank 0's process is gone (PR_SET_PDEATHSIG covers only the spawning thread)
