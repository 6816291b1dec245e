"""A worker killed with SIGKILL is detected, restarted with back-off, and serves again; the
other model's worker keeps serving meanwhile. In-process, on the tiny model."""

from __future__ import annotations

import logging
import os
import re
import signal

from tests.server.conftest import TINY as MODEL
from tests.server.conftest import TINY_ARCHIVE as ARCHIVE


def worker(server, model):
    [desc] = server.get("management", f"/models/{model}").json()
    [w] = desc["workers"]
    return w


def test_kill_9_worker_is_restarted_with_backoff(inprocess_factory, caplog):
    caplog.set_level(logging.INFO, logger="pagedserve.server.workers.pool")
    s = inprocess_factory(load_models=[f"{MODEL}={ARCHIVE}", f"other={ARCHIVE}"])
    first = worker(s, MODEL)
    other = worker(s, "other")
    os.kill(first["pid"], signal.SIGKILL)
    s.wait_for(
        lambda: worker(s, MODEL)["status"] != "READY" or worker(s, MODEL)["restarts"], timeout=60, what="death detected"
    )
    # The other model never noticed.
    assert s.predict("other").status == 200
    assert worker(s, "other")["pid"] == other["pid"]

    s.wait_for(lambda: worker(s, MODEL)["status"] == "READY", timeout=120, what="worker restarted")
    second = worker(s, MODEL)
    assert second["pid"] != first["pid"] and second["id"] == first["id"]
    assert second["restarts"] == 1
    r = s.predict(MODEL)
    assert r.status == 200, r.text
    assert r.json()["choices"][0]["text"]

    # Dying again soon after: the back-off doubles.
    os.kill(second["pid"], signal.SIGKILL)
    # One describe per check: two could see the old worker READY, then the count of its death.
    s.wait_for(
        lambda: (w := worker(s, MODEL))["status"] == "READY" and w["restarts"] == 2, timeout=120, what="second restart"
    )
    delays = [float(d) for d in re.findall(r"died; restarting in ([0-9.]+)s", caplog.text)]
    assert delays == [0.5, 1.0]
    assert s.predict(MODEL).status == 200
