"""The shared Redis tier's health, as the KV offload manager sees it before each lookup.

LMCache's Redis connector waits on the server without a time limit and only logs its failures;
`RemoteProbe.check` pings the server with a short timeout so the manager can count a Redis that
is down or too slow, and not wait on a slow one. A PING costs one loopback round trip.
"""

from __future__ import annotations

import enum

PROBE_TIMEOUT_S = 0.25


class RemoteState(str, enum.Enum):
    UP = "up"
    DOWN = "down"  # refused or closed: fails fast
    SLOW = "not answering"  # accepted but no answer in time: waiting would stall the engine


class RemoteProbe:
    def __init__(self, url: str, timeout: float = PROBE_TIMEOUT_S) -> None:
        import redis  # LMCache's own dependency

        self._redis = redis
        self._client = redis.Redis.from_url(
            url, socket_timeout=timeout, socket_connect_timeout=timeout, retry_on_timeout=False
        )

    def check(self) -> RemoteState:
        try:
            self._client.ping()
        except self._redis.exceptions.TimeoutError:
            return RemoteState.SLOW
        except (self._redis.exceptions.ConnectionError, OSError):
            return RemoteState.DOWN
        return RemoteState.UP

    def close(self) -> None:
        self._client.close()


class _ClosedConnector:
    """What a Redis backend holds once `close_redis_backend` closed its connector."""

    async def close(self) -> None:
        return None


def close_redis_backend(backend, timeout: float = 10.0) -> None:
    """Close LMCache's Redis backend without its own `close`, which deadlocks in lmcache 0.5.6:
    `RedisConnector.close` runs on the backend's event loop and calls its job executor's
    blocking `shutdown`, which waits for a coroutine on that same loop. Do what it means to (stop
    the executor, close the connection pool) on the loop, bounded by `timeout` (writes still
    queued for a Redis that does not answer are dropped), and leave the backend a connector whose
    close does nothing, for LMCache's own shutdown that follows."""
    import asyncio

    wrapper = backend.connection
    if wrapper is None:
        return
    inner = wrapper.getWrappedConnector() if hasattr(wrapper, "getWrappedConnector") else wrapper

    async def close() -> None:
        await inner.pq_executor.shutdown_async(wait=True)
        await inner.connection.aclose()

    future = asyncio.run_coroutine_threadsafe(close(), backend.loop)
    try:
        future.result(timeout)
    except Exception:  # noqa: BLE001 - a stuck or failed close must not stop the shutdown
        future.cancel()
    backend.connection = _ClosedConnector()


class PendingWrites:
    """Counts the keys of the batched writes LMCache has queued for its Redis backend and not
    finished yet (`pending`; with the backend's `put_tasks`, everything still on its way).

    lmcache 0.5.6 fills `put_tasks` only on its one-key path; its batched path, the one its
    Redis connector takes, only removes keys from the set, so `put_tasks` is empty while a batch
    is still being written. Installed on the backend instance, this wraps the batched submit and
    counts each key down in the completion callback that LMCache calls once per key after the
    write ended, failed or not. Batches that LMCache sends down the one-key path (a connector
    without batched writes) or drops (no connection) are left to `put_tasks`."""

    def __init__(self, backend) -> None:
        import threading

        self._backend = backend
        self._lock = threading.Lock()
        self._pending = 0
        self._submit = backend.batched_submit_put_task
        backend.batched_submit_put_task = self._submit_batch

    @property
    def pending(self) -> int:
        with self._lock:
            return self._pending

    def _add(self, n: int) -> None:
        with self._lock:
            self._pending += n

    def _submit_batch(self, keys, memory_objs, transfer_spec=None, on_complete_callback=None):
        connection = self._backend.connection
        batched = (
            connection is not None
            and not getattr(self._backend, "_mla_worker_id_as0_mode", False)
            and connection.support_batched_put()
        )
        if not batched:
            return self._submit(
                keys, memory_objs, transfer_spec=transfer_spec, on_complete_callback=on_complete_callback
            )
        keys = list(keys)

        def done(key) -> None:
            self._add(-1)
            if on_complete_callback is not None:
                on_complete_callback(key)

        self._add(len(keys))
        try:
            return self._submit(keys, memory_objs, transfer_spec=transfer_spec, on_complete_callback=done)
        except BaseException:
            self._add(-len(keys))
            raise
