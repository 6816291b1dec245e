"""Scaling a model's workers up and down is routine: nothing about it is logged at ERROR
(issue 34: a worker stopped on purpose was logged as "died")."""

from __future__ import annotations

import logging

from tests.server.conftest import TINY


def test_scaling_up_and_down_logs_no_error(inprocess_factory, caplog):
    server = inprocess_factory(load_models=[f"{TINY}={TINY}.mar"])
    caplog.set_level(logging.INFO)
    for workers in (2, 1, 2, 1):
        r = server.put("management", f"/models/{TINY}/1.0?min_worker={workers}&synchronous=true")
        assert r.status == 200, r.text
        server.wait_for(
            lambda: len(server.get("management", f"/models/{TINY}").json()[0]["workers"]) == workers,
            60,
            what=f"{workers} worker(s)",
        )
    assert server.predict(TINY).status == 200
    errors = [f"{r.name}: {r.getMessage()}" for r in caplog.records if r.levelno >= logging.ERROR]
    assert not errors, errors
    stopped = [
        r for r in caplog.records if "stopped" in r.getMessage() and r.name == "pagedserve.engine.core.async_llm"
    ]
    assert all(r.levelno == logging.INFO for r in stopped)
