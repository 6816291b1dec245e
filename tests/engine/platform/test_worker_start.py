"""How engine workers start (pagedserve.engine.platform.worker_start): forked from a fork server
that preloaded the engine core on a machine without a GPU driver (spawned where one is loaded),
each with the environment of its own start, not the fork server's."""

from __future__ import annotations

import os
import sys

import pytest

from pagedserve.engine.platform.worker_start import (
    PRELOAD,
    apply_environment,
    gpu_driver_present,
    worker_context,
    worker_environment,
)


def report(environ: dict[str, str], queue) -> None:
    """A worker's first steps: the environment it was handed, then what it sees."""
    apply_environment(environ)
    queue.put((os.environ.get("PAGEDSERVE_TEST_MARK"), all(name in sys.modules for name in PRELOAD)))


def _start(context, monkeypatch, mark: str) -> tuple[str | None, bool]:
    monkeypatch.setenv("PAGEDSERVE_TEST_MARK", mark)
    queue = context.Queue()
    process = context.Process(target=report, args=(worker_environment(), queue))
    process.start()
    try:
        return queue.get(timeout=120)
    finally:
        process.join(30)
        assert process.exitcode == 0


@pytest.mark.skipif(gpu_driver_present(), reason="with a GPU driver, workers are spawned")
def test_workers_fork_from_a_preloaded_server_with_the_environment_of_their_start(monkeypatch):
    context = worker_context()
    assert context.get_start_method() == "forkserver"
    # The first start starts the fork server, which keeps this environment...
    assert _start(context, monkeypatch, "first") == ("first", True)
    # ...and a later worker still sees the environment of its own start, the engine preloaded.
    assert _start(context, monkeypatch, "second") == ("second", True)


def test_apply_environment_replaces_the_whole_environment(monkeypatch):
    monkeypatch.setenv("PAGEDSERVE_TEST_MARK", "stale")
    saved = dict(os.environ)
    try:
        apply_environment({"PATH": saved.get("PATH", ""), "PAGEDSERVE_TEST_OTHER": "1"})
        assert "PAGEDSERVE_TEST_MARK" not in os.environ and os.environ["PAGEDSERVE_TEST_OTHER"] == "1"
    finally:
        apply_environment(saved)
    assert os.environ["PAGEDSERVE_TEST_MARK"] == "stale"
