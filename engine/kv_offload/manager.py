"""KV offload through LMCache: the engine-facing lookup / load / store, faults and counters.

Flow per request (the scheduler and engine core call in):

1. `lookup(request, num_computed)` before a waiting request is scheduled: how many tokens past
   the engine's own prefix-cache hit LMCache holds (whole blocks; at least one prompt token is
   always left to compute). The keys it finds are pinned until the load.
2. `load(request, block_ids, start, end)` once blocks are allocated: copies the KV into the
   fresh blocks and returns how many tokens really arrived (a prefix of the range). The
   scheduler counts only those as computed.
3. `store_computed(...)` after each executed step: chunks of the prompt whose KV is complete
   and not yet in LMCache are copied out, one chunk per call, and at the end of the prefill the
   prompt's tail chunk cut to whole blocks; LMCache writes them through to disk on its own I/O
   thread.

Faults (LMCache raising, a chunk that cannot be read, a failed disk write, an unwritable disk
folder, a Redis server that is down or not answering) are logged as warnings and counted; the
affected tokens are simply recomputed.
"""

from __future__ import annotations

import hashlib
import logging
import multiprocessing
import os
import threading
import time
import uuid
import weakref
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from pagedserve.engine.config.kv_offload import KVOffloadConfig
from pagedserve.engine.kv_offload.disk import DiskBudget, check_writable
from pagedserve.engine.kv_offload.keys import chunk_hash
from pagedserve.engine.kv_offload.remote import PendingWrites, RemoteProbe, RemoteState, close_redis_backend
from pagedserve.engine.kv_offload.stats import KVOffloadStats

logger = logging.getLogger(__name__)

CPU_BACKEND = "LocalCPUBackend"
DISK_PLUGIN = "fs"
DISK_BACKEND = f"RemoteBackend-{DISK_PLUGIN}"
REDIS_PLUGIN = "redis"
REDIS_BACKEND = f"RemoteBackend-{REDIS_PLUGIN}"


def _quiet_lmcache_environment() -> None:
    """No telemetry, no network, warnings only. Must run before LMCache is imported."""
    os.environ["LMCACHE_TRACK_USAGE"] = "false"
    os.environ["DO_NOT_TRACK"] = "1"
    os.environ.setdefault("LMCACHE_LOG_LEVEL", "WARNING")


@dataclass(slots=True)
class _PendingLoad:
    lookup_id: str
    hit_end: int  # tokens LMCache holds (chunk-aligned)
    cpu_end: int  # the first cpu_end tokens of it are in the CPU tier,
    disk_end: int  # then up to disk_end on disk, the rest in Redis


class KVOffloadManager:
    """One LMCache engine per EngineCore, bound to its paged KV caches."""

    def __init__(
        self,
        config: KVOffloadConfig,
        kv_caches: list[torch.Tensor],
        block_size: int,
        model_id: str,
    ) -> None:
        _quiet_lmcache_environment()
        from lmcache.v1.cache_engine import LMCacheEngineBuilder
        from lmcache.v1.config import LMCacheEngineConfig
        from lmcache.v1.metadata import LMCacheMetadata

        from pagedserve.engine.kv_offload.connector import PagedKVConnector

        self.config = config
        self.block_size = block_size
        self.chunk_size = config.chunk_size
        self.stats = KVOffloadStats()
        self._last_fault_time: float | None = None  # time.perf_counter() of the latest fault
        self._builder = LMCacheEngineBuilder
        self._closed = False
        _, _, _, heads, head_dim = kv_caches[0].shape
        dtype = kv_caches[0].dtype
        self.device = kv_caches[0].device
        self.chunk_bytes = 2 * len(kv_caches) * self.chunk_size * heads * head_dim * dtype.itemsize
        if 2 * self.chunk_bytes > config.cpu_size_gb * 1024**3:
            raise ValueError(
                f"kv_offload.cpu_size_gb={config.cpu_size_gb} holds fewer than 2 chunks "
                f"of {self.chunk_bytes} bytes (chunk_size {self.chunk_size})"
            )

        self.disk: DiskBudget | None = None
        extra: dict[str, Any] = {}
        if config.disk_path is not None:
            path = Path(config.disk_path)
            try:
                check_writable(path)
            except OSError as exc:
                self._fault(
                    "disk_unwritable", f"disk folder {path} is not writable ({exc}); running with the CPU tier only"
                )
            else:
                assert config.disk_size_gb is not None  # KVOffloadConfig requires it with disk_path
                self.disk = DiskBudget(path, int(config.disk_size_gb * 1024**3))
                extra = {f"remote_storage_plugin.{DISK_PLUGIN}.base_path": str(path), "use_exists_sync": True}
        plugins = [DISK_PLUGIN] if self.disk is not None else []
        if config.remote_url is not None:  # behind the CPU and disk tiers (LMCache asks in order)
            plugins.append(REDIS_PLUGIN)
            extra[f"remote_storage_plugin.{REDIS_PLUGIN}.redis_url"] = config.remote_url

        self.instance_id = f"pagedserve-{uuid.uuid4().hex}"
        lmc_config = LMCacheEngineConfig.from_defaults(
            chunk_size=self.chunk_size,
            local_cpu=True,
            max_local_cpu_size=config.cpu_size_gb,
            local_disk=None,
            remote_url=None,
            remote_serde="naive",
            save_unfull_chunk=True,  # the prompt's tail chunk, cut to whole blocks (see store_computed)
            remote_storage_plugins=plugins or None,
            extra_config=extra or None,
            lmcache_instance_id=self.instance_id,
        )
        metadata = LMCacheMetadata(
            model_name=model_id,
            world_size=1,
            local_world_size=1,
            worker_id=0,
            local_worker_id=0,
            kv_dtype=dtype,
            kv_shape=(len(kv_caches), 2, self.chunk_size, heads, head_dim),
            chunk_size=self.chunk_size,
        )
        self._connector = PagedKVConnector(kv_caches, block_size)
        start_method = multiprocessing.get_start_method(allow_none=True)
        try:
            self.engine = LMCacheEngineBuilder.get_or_create(
                self.instance_id,
                lmc_config,
                metadata,
                self._connector,
                _no_broadcast,
                _no_broadcast,
            )
        finally:
            # LMCacheEngine forces the process-wide start method to "spawn"; we start no
            # LMCache subprocess, so give the host process its own setting back.
            multiprocessing.set_start_method(start_method, force=True)
        try:
            self.engine.post_init()
            self.engine.token_database.hash_func = chunk_hash
            backends = self.engine.storage_manager.storage_backends
            self._disk_backend = backends.get(DISK_BACKEND)
            if self.disk is not None and self._disk_backend is None:
                self._fault("disk_unavailable", "LMCache could not open the disk tier; CPU tier only")
                self.disk = None
            self._redis_backend = backends.get(REDIS_BACKEND)
            self._redis_writes = PendingWrites(self._redis_backend) if self._redis_backend is not None else None
            if config.remote_url is not None and self._redis_backend is None:
                self._fault(
                    "remote_unavailable",
                    f"LMCache could not open the Redis tier at {config.remote_url}; running without it",
                )
        except BaseException:
            self.close()
            raise
        self._disk_put_failures = 0
        self._remote = RemoteProbe(config.remote_url) if config.remote_url is not None else None
        self._retrieve_batch = max(1, int(config.cpu_size_gb * 1024**3 / 4) // self.chunk_bytes)
        self._lookup_counter = 0
        self._pending: dict[str, _PendingLoad] = {}
        self._stored: dict[str, int] = {}  # request id -> prompt tokens known to be in LMCache
        self._no_load: set[str] = set()  # requests whose load failed: recompute, don't retry
        # Release LMCache (its I/O thread is not a daemon) before the interpreter joins threads,
        # even if the owner never calls close(). Only a weak reference: no leak of the manager
        # (and the KV pool its connector points at) after close.
        register = getattr(threading, "_register_atexit", None)
        if register is not None:
            try:
                register(_close_at_exit, weakref.ref(self))
            except RuntimeError:
                pass  # interpreter already shutting down

    # -- scheduler side --------------------------------------------------------------------
    def lookup(self, request, num_computed: int) -> int:
        """Tokens after `num_computed` that a `load` would restore now (a multiple of the block
        size, leaving at least the last token to compute), or 0."""
        rid = request.request_id
        self._release(rid)
        if rid in self._no_load:
            return 0
        bs = self.block_size
        max_end = (request.num_tokens - 1) // bs * bs
        if max_end < self.chunk_size or (max_end <= num_computed and rid in self._stored):
            return 0
        # Keys cover [0, max_end): whole chunks, then the tail cut to whole blocks, which matches
        # the tail chunk a request with the same prompt stored.
        tokens = request.all_token_ids[:max_end]
        if self._remote is not None and not self._remote_usable(self._remote, rid):
            return 0
        self._lookup_counter += 1
        lookup_id = f"{rid}#{self._lookup_counter}"
        self.stats.lookups += 1
        try:
            hit = self.engine.lookup(
                tokens=tokens, lookup_id=lookup_id, pin=True, request_configs=_request_configs(request)
            )
            mapping = self.engine.lookup_pins.get(lookup_id, {})
        except Exception as exc:  # noqa: BLE001 - any LMCache failure means "recompute"
            self._fault("lookup", f"LMCache lookup failed for {rid}: {exc!r}")
            self._unpin(lookup_id)
            return 0
        self._stored[rid] = max(self._stored.get(rid, 0), hit)
        end = hit
        if end <= num_computed:
            self._unpin(lookup_id)
            return 0
        # LMCache asks the tiers in order: CPU, then disk, then Redis, each for the chunks after
        # the previous tier's hits.
        cpu_end = len(mapping.get(CPU_BACKEND, ())) * self.chunk_size
        disk_end = cpu_end + len(mapping.get(DISK_BACKEND, ())) * self.chunk_size
        self._pending[rid] = _PendingLoad(lookup_id, hit, cpu_end, disk_end)
        return end - num_computed

    def load(self, request, block_ids: list[int], start: int, end: int) -> int:
        """Copy tokens [start, end) (from `lookup`) into the request's blocks. Returns how many
        tokens from `start` were really restored; on a shortfall the request is not offered
        LMCache again (it recomputes)."""
        rid = request.request_id
        pending = self._pending.pop(rid, None)
        if pending is None:
            raise RuntimeError(f"load({rid!r}) without a pending lookup")
        t0 = time.perf_counter()
        loaded_end = start
        C = self.chunk_size
        try:
            ids = torch.tensor(block_ids, dtype=torch.int64, device=self.device)
            tokens = request.all_token_ids
            configs = _request_configs(request)
            # LMCache holds every chunk of one retrieve in its CPU tier at once (a disk retrieve
            # larger than the tier would block), so retrieve in batches of a quarter of the tier;
            # the chunks of one batch are read from disk concurrently.
            starts = list(range(start // C * C, end, C))
            for i in range(0, len(starts), self._retrieve_batch):
                batch_start = starts[i]
                batch_end = min(starts[min(i + self._retrieve_batch, len(starts)) - 1] + C, pending.hit_end)
                mask = torch.ones(batch_end, dtype=torch.bool)
                mask[:batch_start] = False
                ret = self.engine.retrieve(
                    tokens[:batch_end],
                    mask=mask,
                    req_id=pending.lookup_id,
                    request_configs=configs,
                    block_ids=ids,
                    load_start=start,
                    load_end=end,
                )
                # LMCache writes (and marks) only a prefix of the chunks: up to the first missing.
                got = int(ret[batch_start:batch_end].long().cumprod(0).sum())
                loaded_end = max(loaded_end, min(batch_start + got, end))
                if got < batch_end - batch_start:
                    break
        except Exception as exc:  # noqa: BLE001
            self._fault("load", f"LMCache load failed for {rid}: {exc!r}")
            loaded_end = start  # a chunk may be half written: trust none of it
        finally:
            self._unpin(pending.lookup_id)
        loaded = loaded_end - start
        if loaded < end - start:
            if not self._has_fault_since(t0):
                self._fault(
                    "load_short",
                    f"LMCache restored {loaded} of {end - start} tokens for {rid} "
                    "(a chunk was missing or unreadable); recomputing the rest",
                )
            self._no_load.add(rid)
            # Store the chunks it recomputes again (replacing a bad file), from the last good one.
            self._stored[rid] = min(self._stored.get(rid, 0), loaded_end // C * C)
        elapsed = time.perf_counter() - t0
        self.stats.load_time_s += elapsed
        self.stats.loaded_bytes += loaded * self.chunk_bytes // C
        request.kv_transfer_s += elapsed
        request.kv_transfer_bytes += loaded * self.chunk_bytes // C
        cpu_part = max(0, min(loaded_end, pending.cpu_end) - start)
        disk_part = max(0, min(loaded_end, pending.disk_end) - start) - cpu_part
        self.stats.hit_tokens_cpu += cpu_part
        self.stats.hit_tokens_disk += disk_part
        self.stats.hit_tokens_remote += loaded - cpu_part - disk_part
        return loaded

    def forget(self, request_id: str) -> None:
        """The request finished or was aborted: drop its state (and any pins)."""
        self._release(request_id)
        self._stored.pop(request_id, None)
        self._no_load.discard(request_id)

    # -- engine side -----------------------------------------------------------------------
    def store_computed(self, scheduler_output, requests: dict, get_block_ids) -> None:
        """After a step ran: store each scheduled request's newly complete prompt chunks.

        Whole chunks are stored as they complete; once the prompt's prefill is done, also its
        tail up to `limit` (whole blocks; the last prompt token is always recomputed), so the
        same prompt again is restored all but its last block.
        """
        C = self.chunk_size
        bs = self.block_size
        for rid in scheduler_output.num_scheduled_tokens:
            request = requests.get(rid)
            if request is None:
                continue
            limit = (request.num_prompt_tokens - 1) // bs * bs
            if limit < C:
                continue  # short prompts: the engine's own prefix cache is enough
            done = min(request.num_computed_tokens, limit)
            end = done if done == limit else done // C * C
            start = self._stored.get(rid, 0)
            if end <= start:
                continue
            self._stored[rid] = end  # never offered twice, even if LMCache fails below
            self._store(request, get_block_ids(rid), start, end)
        self._check_disk_writes()

    def _store(self, request, block_ids: list[int], start: int, end: int) -> None:
        t0 = time.perf_counter()
        C = self.chunk_size
        stored_bytes = 0
        try:
            ids = torch.tensor(block_ids, dtype=torch.int64, device=self.device)
            tokens = request.all_token_ids
            configs = _request_configs(request)
            for chunk_start in range(start, end, C):
                chunk_end = min(chunk_start + C, end)
                nbytes = (chunk_end - chunk_start) * self.chunk_bytes // C
                if self.disk is not None:
                    self.stats.disk_pruned_files += self.disk.account(nbytes)
                mask = torch.ones(chunk_end, dtype=torch.bool)
                mask[:chunk_start] = False
                self.engine.store(
                    tokens[:chunk_end], mask=mask, block_ids=ids, req_id=request.request_id, request_configs=configs
                )
                self.stats.stored_chunks += 1
                self.stats.stored_tokens += chunk_end - chunk_start
                self.stats.stored_bytes += nbytes
                stored_bytes += nbytes
        except Exception as exc:  # noqa: BLE001
            self._fault("store", f"LMCache store failed for {request.request_id}: {exc!r}")
        elapsed = time.perf_counter() - t0
        self.stats.store_time_s += elapsed
        request.kv_transfer_s += elapsed
        request.kv_transfer_bytes += stored_bytes

    def _check_disk_writes(self) -> None:
        """Count disk writes that failed on LMCache's I/O thread since the last check."""
        backend = self._disk_backend if self.disk is not None else None
        if backend is None:
            return
        failed = backend.put_failed_count
        if failed > self._disk_put_failures:
            new = failed - self._disk_put_failures
            self._disk_put_failures = failed
            for _ in range(new):
                self.stats.count_fault("disk_write")
            logger.warning(
                "KV offload: %d chunk write(s) to %s failed (disk full or not writable); "
                "those chunks stay in the CPU tier only",
                new,
                self.config.disk_path,
            )

    def flush(self, timeout: float = 30.0) -> bool:
        """Wait until queued disk writes have finished (True) or `timeout` passed (False)."""
        backend = self._disk_backend if self.disk is not None else None
        deadline = time.monotonic() + timeout
        while backend is not None and backend.put_tasks:
            if time.monotonic() > deadline:
                return False
            time.sleep(0.005)
        self._check_disk_writes()
        if self.disk is not None:  # writes landed: the folder's real size is known now
            self.stats.disk_pruned_files += self.disk.enforce()
        return True

    def wait_for_writes(self, timeout: float = 30.0) -> bool:
        """Wait until the queued writes to the shared tiers (disk folder, Redis) have landed, so
        another process's lookup finds them (True), or `timeout` passed (False, a fault: the
        reader then recomputes what it misses). A prefill worker calls this before it reports a
        disaggregated request finished."""
        backends = [b for b in (self._disk_backend if self.disk is not None else None, self._redis_backend) if b]
        deadline = time.monotonic() + timeout
        while any(b.put_tasks for b in backends) or (self._redis_writes is not None and self._redis_writes.pending):
            if time.monotonic() > deadline:
                self._fault("write_timeout", f"writes to the shared tiers not done within {timeout:g} s")
                return False
            time.sleep(0.001)
        self._check_disk_writes()
        return True

    def get_stats(self) -> dict:
        self._check_disk_writes()
        return self.stats.as_dict()

    def close(self) -> None:
        """Finish queued disk writes, then destroy the LMCache engine (its threads end)."""
        if self._closed:
            return
        self._closed = True
        try:
            if getattr(self, "_disk_backend", None) is not None:
                self.flush(timeout=30.0)
        finally:
            if getattr(self, "_redis_backend", None) is not None:
                close_redis_backend(self._redis_backend)
            self._builder.destroy(self.instance_id)
            if (remote := getattr(self, "_remote", None)) is not None:
                remote.close()
            self._connector.kv_caches = []  # drop LMCache's path to the engine's KV pool

    # -- helpers ---------------------------------------------------------------------------
    def _release(self, rid: str) -> None:
        pending = self._pending.pop(rid, None)
        if pending is not None:
            self._unpin(pending.lookup_id)

    def _unpin(self, lookup_id: str) -> None:
        try:
            self.engine.lookup_unpin(lookup_id)
        except Exception as exc:  # noqa: BLE001
            self._fault("unpin", f"LMCache unpin failed: {exc!r}")

    def _remote_usable(self, remote: RemoteProbe, rid: str) -> bool:
        """Ping Redis before a lookup (LMCache waits on Redis without a time limit, and counts
        nothing). Down (refused): counted, warned, and the lookup goes on: LMCache fails fast
        there and the local tiers still serve. Slow (no answer within the probe's timeout):
        counted, warned, and this request recomputes rather than wait."""
        state = remote.check()
        if state is RemoteState.UP:
            return True
        kind = "remote_down" if state is RemoteState.DOWN else "remote_slow"
        self._fault(
            kind,
            f"Redis at {self.config.remote_url} is {state.value}; request {rid} "
            + ("uses the local tiers only" if state is RemoteState.DOWN else "recomputes its prompt"),
        )
        return state is RemoteState.DOWN

    def _fault(self, kind: str, message: str) -> None:
        self.stats.count_fault(kind)
        self._last_fault_time = time.perf_counter()
        logger.warning("KV offload: %s", message)

    def _has_fault_since(self, t: float) -> bool:
        return self._last_fault_time is not None and self._last_fault_time >= t


def _request_configs(request) -> dict | None:
    """Requests with a cache salt or LoRA adapter get their own keys (a tag in the key)."""
    extra = request.extra_keys
    if extra is None:
        return None
    return {"lmcache.tag.salt": hashlib.sha256(repr(extra).encode()).hexdigest()[:32]}


def _no_broadcast(*args, **kwargs):
    return None


def _close_at_exit(ref: weakref.ref) -> None:
    manager = ref()
    if manager is not None:
        manager.close()
