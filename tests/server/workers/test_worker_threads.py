"""Workers share the cores: each new worker is sized for the workers there will be, and the
ones already running are resized when workers come and go (a worker sized for fewer
neighbours would oversubscribe the cores). The thread counts are the workers' own reports.
In-process, on the tiny model."""

from __future__ import annotations

import os

import pytest

from tests.server.conftest import TINY as MODEL
from tests.server.conftest import TINY_ARCHIVE as ARCHIVE

pytestmark = pytest.mark.skipif((os.cpu_count() or 1) < 2, reason="one core: every share is one thread")


def thread_counts(server) -> list[int]:
    [desc] = server.get("management", f"/models/{MODEL}").json()
    return sorted(w["threads"] for w in desc["workers"] if w["status"] == "READY")


def test_threads_are_rebalanced_when_workers_come_and_go(inprocess_factory):
    cores = os.cpu_count()
    # The tests pin worker_threads=1 by default; this one lets the server share the cores.
    server = inprocess_factory(load_models=[f"{MODEL}={ARCHIVE}"], worker_threads=None)
    server.wait_for(lambda: thread_counts(server) == [cores], timeout=30, what="one worker on every core")

    r = server.put("management", f"/models/{MODEL}?min_worker=2&synchronous=true")
    assert r.status == 200, r.text
    half = [max(1, cores // 2)] * 2
    server.wait_for(lambda: thread_counts(server) == half, timeout=30, what="two workers sharing the cores")

    r = server.put("management", f"/models/{MODEL}?min_worker=1&synchronous=true")
    assert r.status == 200, r.text
    server.wait_for(lambda: thread_counts(server) == [cores], timeout=30, what="the last worker on every core")
    r = server.predict(MODEL)
    assert r.status == 200 and r.json()["choices"][0]["text"]
