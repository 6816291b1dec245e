"""Registration of archives that must not serve: handler code without --allow-custom-handlers
(400, nothing started) and an engine configuration that cannot start (500 when synchronous,
nothing left registered; retried with back-off when asynchronous), and snapshot entries of
such archives, which are kept rather than lost. In-process, on the tiny model."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest

from tests.server.conftest import TINY as MODEL
from tests.server.conftest import TINY_ARCHIVE as ARCHIVE


@pytest.fixture(scope="module")
def tiny_archives(tiny_store, tiny_model, tmp_path_factory):
    """Tiny random Llama archives in model_store/tiny/: one with a handler .py, one whose KV
    pool (2 blocks) cannot hold its max_model_len (the engine refuses to start)."""
    from pagedserve.engine.model.archive import write_archive

    tmp = tmp_path_factory.mktemp("tiny")
    handler = tmp / "my_handler.py"
    handler.write_text("def handle(data, context):\n    return data\n")
    broken = tmp / "model-config.yaml"
    # startupTimeout: a start that hangs instead of failing is still given up on quickly.
    broken.write_text("startupTimeout: 20\nhandler:\n  max_model_len: 256\n  num_kv_blocks: 2\n")
    dest = tiny_store / "tiny"
    write_archive(tiny_model, dest, model_name="tinyhandler", version="1.0", handler=str(handler), force=True)
    write_archive(tiny_model, dest, model_name="tinybroken", version="1.0", config_file=broken, force=True)
    return {"handler": "tiny/tinyhandler.mar", "broken": "tiny/tinybroken.mar"}


@pytest.fixture(scope="module")
def mgmt(inprocess_factory):
    return inprocess_factory(enable_model_api=True)


def test_custom_handler_code_is_refused(mgmt, tiny_archives):
    r = mgmt.post("management", f"/models?url={tiny_archives['handler']}&synchronous=true")
    assert r.status == 400, r.text
    assert "my_handler" in r.json()["message"]
    assert mgmt.get("management", "/models/tinyhandler").status == 404


def test_worker_that_cannot_start_gives_500_when_synchronous(mgmt, tiny_archives):
    r = mgmt.post("management", f"/models?url={tiny_archives['broken']}&synchronous=true")
    assert r.status == 500, r.text
    body = r.json()
    assert body["type"] == "InternalServerException"
    assert "Failed to start workers" in body["message"] and "KV pool" in body["message"]
    assert mgmt.get("management", "/models/tinybroken").status == 404
    assert mgmt.get("management", "/models").json() == {"models": []}


def test_worker_that_cannot_start_is_retried_when_asynchronous(mgmt, tiny_archives):
    r = mgmt.post("management", f"/models?url={tiny_archives['broken']}")
    assert r.status == 202, r.text

    def failing():
        [w] = mgmt.get("management", "/models/tinybroken").json()[0]["workers"]
        return w["lastError"] and w["status"] in ("RESTARTING", "STARTING")

    mgmt.wait_for(failing, timeout=90, what="start failure recorded")
    assert mgmt.predict("tinybroken").status == 503
    assert mgmt.delete("management", "/models/tinybroken").status == 200


def _workers_of(pid: int = os.getpid()) -> list[int]:
    """Live engine-core processes started by process `pid` (the in-process server's: this one):
    its spawned children, or the children of its multiprocessing fork server
    (pagedserve.engine.platform.worker_start)."""
    procs: dict[int, tuple[int, str, bytes]] = {}
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
            procs[int(stat.parent.name)] = (int(fields[1]), fields[0], (stat.parent / "cmdline").read_bytes())
        except OSError:
            continue
    forkservers = {p for p, (ppid, _, cmd) in procs.items() if ppid == pid and b"multiprocessing.forkserver" in cmd}
    return [
        p
        for p, (ppid, state, cmd) in procs.items()
        if state != "Z" and ((ppid == pid and b"spawn_main" in cmd) or ppid in forkservers)
    ]


def test_unregister_and_scale_down_while_workers_start(mgmt):
    """Removing workers that are still loading kills them cleanly; the server keeps running."""
    for _ in range(2):
        r = mgmt.post("management", f"/models?url={ARCHIVE}&initial_workers=2")
        assert r.status == 202, r.text
        mgmt.wait_for(lambda: len(_workers_of()) == 2, timeout=60, what="both worker processes loading the model")
        r = mgmt.put("management", f"/models/{MODEL}?min_worker=1")
        assert r.status == 202, r.text
        r = mgmt.delete("management", f"/models/{MODEL}")
        assert r.status == 200, r.text
        mgmt.wait_for(lambda: not _workers_of(), timeout=30, what="no worker process left")
    assert mgmt.get("management", "/models").json() == {"models": []}
    r = mgmt.post("management", f"/models?url={ARCHIVE}&synchronous=true")
    assert r.status == 200, r.text
    assert mgmt.predict(MODEL).status == 200
    assert mgmt.delete("management", f"/models/{MODEL}").status == 200


def test_snapshot_entries_that_cannot_be_restored_are_not_lost(inprocess_factory, tiny_archives, tmp_path, caplog):
    """A missing archive and a refused one stay in the snapshot for the next start; a version
    whose workers cannot start is registered anyway, its workers retrying in the background."""
    workdir = tmp_path / "srv"
    workdir.mkdir()
    entries = [
        {
            "name": "tinybroken",
            "version": "1.0",
            "url": tiny_archives["broken"],
            "min_workers": 1,
            "max_workers": 1,
            "default": True,
        },
        {"name": "gone", "version": "1.0", "url": "tiny/gone.mar", "min_workers": 1, "max_workers": 1, "default": True},
        {
            "name": "tinyhandler",
            "version": "1.0",
            "url": tiny_archives["handler"],
            "min_workers": 1,
            "max_workers": 1,
            "default": True,
        },
    ]
    (workdir / "snapshot.json").write_text(json.dumps({"format": 1, "models": entries}))
    server = inprocess_factory(snapshot_path=str(workdir / "snapshot.json"), ready=False)
    server.wait_for(lambda: "pagedserve: ready" in server.log_text(), what="start finished")

    assert [m["modelName"] for m in server.get("management", "/models").json()["models"]] == ["tinybroken"]
    [w] = server.get("management", "/models/tinybroken").json()[0]["workers"]
    assert w["status"] in ("STARTING", "RESTARTING")
    server.wait_for(
        lambda: server.get("management", "/models/tinybroken").json()[0]["workers"][0]["lastError"],
        timeout=60,
        what="the start failure recorded",
    )
    log = caplog.text
    assert "could not restore gone 1.0" in log and "could not restore tinyhandler 1.0" in log
    saved = json.loads((workdir / "snapshot.json").read_text())["models"]
    assert sorted(e["name"] for e in saved) == ["gone", "tinybroken", "tinyhandler"]
