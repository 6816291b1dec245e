"""The management API's whole lifecycle, in-process with real workers on the tiny model:
register (sync and async), list with paging, describe, scale up and down, a second version,
set-default, predict against each version, unregister; TorchServe's status codes and shapes,
allowed_urls, snapshots."""

from __future__ import annotations

import json
import os
import signal
import threading
from pathlib import Path

import pytest

from tests.server.conftest import TINY as MODEL
from tests.server.conftest import TINY_ARCHIVE as ARCHIVE
from tests.server.conftest import TINY_ARCHIVE_V2


@pytest.fixture(scope="module")
def mgmt(inprocess_factory, tmp_path_factory):
    """A server with the model API on and nothing registered at start."""
    snapshot = tmp_path_factory.mktemp("mgmt") / "snapshot.json"
    return inprocess_factory(enable_model_api=True, snapshot_path=str(snapshot))


@pytest.fixture(scope="module")
def archive_v2() -> str:
    return TINY_ARCHIVE_V2


def snapshot_models(server) -> list[dict]:
    return json.loads(Path(server.config.snapshot_path).read_text())["models"]


def describe(server, path=f"/models/{MODEL}"):
    r = server.get("management", path)
    assert r.status == 200, r.text
    return r.json()


def ready_pids(desc) -> list[int]:
    return [w["pid"] for w in desc["workers"] if w["status"] == "READY"]


def alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return True


def test_register_synchronously_then_describe(mgmt):
    r = mgmt.post("management", f"/models?url={ARCHIVE}&initial_workers=1&synchronous=true")
    assert r.status == 200, r.text
    assert r.json() == {"status": f'Model "{MODEL}" Version: 1.0 registered with 1 initial workers'}
    [desc] = describe(mgmt)
    assert desc["modelName"] == MODEL and desc["modelVersion"] == "1.0"
    assert desc["modelUrl"] == ARCHIVE
    assert (desc["minWorkers"], desc["maxWorkers"]) == (1, 2)  # maxWorkers from model-config
    assert desc["batchSize"] == 1 and desc["loadedAtStartup"] is False
    assert desc["jobQueueStatus"] == {"remainingCapacity": 100, "pendingRequests": 0}
    [worker] = desc["workers"]
    assert worker["status"] == "READY" and worker["gpu"] is False
    assert set(worker) >= {"id", "startTime", "status", "memoryUsage", "pid", "gpu"}
    assert alive(worker["pid"]) and worker["memoryUsage"] > 0
    r = mgmt.predict(MODEL, "1.0")
    assert r.status == 200, r.text
    assert r.json()["choices"][0]["text"]


def test_register_the_same_version_again_is_a_conflict(mgmt):
    r = mgmt.post("management", f"/models?url={ARCHIVE}&initial_workers=1&synchronous=true")
    assert r.status == 409, r.text
    body = r.json()
    assert body["code"] == 409 and body["type"] and "already registered" in body["message"]


@pytest.mark.parametrize(
    "query, status, words",
    [
        ("", 400, "url"),
        (f"?url={ARCHIVE}&initial_workers=-1", 400, "initial_workers"),
        (f"?url={ARCHIVE}&synchronous=maybe", 400, "synchronous"),
        (f"?url={ARCHIVE}&bogus=1", 400, "bogus"),
        ("?url=missing.mar", 404, "missing.mar"),
        (f"?url={ARCHIVE}&model_name=bad/name", 400, "model name"),
    ],
)
def test_register_refuses_bad_parameters(mgmt, query, status, words):
    r = mgmt.post("management", f"/models{query}")
    assert r.status == status, r.text
    body = r.json()
    assert body["code"] == status and words in body["message"]


def test_register_refuses_urls_outside_the_store(mgmt, tmp_path, tiny_store, archive_cache):
    outside = tmp_path / "outside.mar"
    os.link(tiny_store / ARCHIVE, outside)  # a valid archive, in the wrong place
    for url in (
        str(outside),
        f"file://{outside}",
        f"../{outside.parent.name}/outside.mar",
        "http://127.0.0.1:9/x.mar",
        "https://example.com/smollm2.mar",
    ):
        r = mgmt.post("management", "/models", json={"url": url, "model_name": "evil"})
        assert r.status == 403, (url, r.text)
        assert r.json()["type"]
    assert not list(archive_cache.glob("outside.mar*"))  # never opened nor extracted
    assert mgmt.get("management", "/models/evil").status == 404


def test_register_a_second_version_asynchronously(mgmt, archive_v2):
    r = mgmt.post("management", "/models", json={"url": archive_v2, "initial_workers": 1})
    assert r.status == 202, r.text  # synchronous defaults to false, as in TorchServe
    assert "Version: 2.0 registered" in r.json()["status"]
    mgmt.wait_for(lambda: ready_pids(describe(mgmt, f"/models/{MODEL}/2.0")[0]), what="version 2.0 ready")
    versions = describe(mgmt, f"/models/{MODEL}/all")
    assert [d["modelVersion"] for d in versions] == ["1.0", "2.0"]
    assert [d["isDefault"] for d in versions] == [True, False]  # the first stays the default
    [default] = describe(mgmt)
    assert default["modelVersion"] == "1.0"


def test_predict_against_each_version(mgmt):
    for path_version in ("1.0", "2.0", None):
        r = mgmt.predict(MODEL, path_version)
        assert r.status == 200, (path_version, r.text)
        assert r.json()["choices"][0]["text"]
    # Same weights, greedy: every version answers the same.
    texts = {mgmt.predict(MODEL, v).json()["choices"][0]["text"] for v in ("1.0", "2.0")}
    assert len(texts) == 1
    r = mgmt.predict(MODEL, "3.0")
    assert r.status == 404, r.text


def test_list_models_with_paging(mgmt):
    r = mgmt.post("management", f"/models?url={ARCHIVE}&model_name=another&initial_workers=0")
    assert r.status == 200, r.text
    assert "registered with 0 initial workers" in r.json()["status"]
    r = mgmt.get("management", "/models")
    assert r.json() == {
        "models": [{"modelName": "another", "modelUrl": ARCHIVE}, {"modelName": MODEL, "modelUrl": ARCHIVE}]
    }
    first = mgmt.get("management", "/models?limit=1").json()
    assert first["models"] == [{"modelName": "another", "modelUrl": ARCHIVE}]
    assert first["nextPageToken"] == "1"
    second = mgmt.get("management", f"/models?limit=1&next_page_token={first['nextPageToken']}")
    assert second.json() == {"models": [{"modelName": MODEL, "modelUrl": ARCHIVE}]}
    for bad in ("limit=0", "limit=x", "next_page_token=-1"):
        assert mgmt.get("management", f"/models?{bad}").status == 400


def test_scale_up_and_down(mgmt):
    r = mgmt.put("management", f"/models/{MODEL}/1.0?min_worker=2&synchronous=true")
    assert r.status == 200, r.text
    assert r.json() == {"status": f"Workers scaled to 2 for model: {MODEL}, version: 1.0"}
    [desc] = describe(mgmt, f"/models/{MODEL}/1.0")
    pids = ready_pids(desc)
    assert len(pids) == 2 and len(set(pids)) == 2 and desc["minWorkers"] == 2
    # Least loaded routing: two concurrent requests land on different workers (stopped, so
    # both requests stay in flight while we look).
    results = []
    threads = [
        threading.Thread(
            target=lambda: results.append(
                mgmt.post(
                    "inference",
                    f"/predictions/{MODEL}/1.0",
                    json={"prompt": "Count: 1, 2,", "max_tokens": 64, "temperature": 0, "ignore_eos": True},
                )
            )
        )
        for _ in range(2)
    ]
    for pid in pids:
        os.kill(pid, signal.SIGSTOP)
    try:
        for t in threads:
            t.start()
        mgmt.wait_for(
            lambda: sum(w["requestsInFlight"] for w in describe(mgmt, f"/models/{MODEL}/1.0")[0]["workers"]) == 2,
            timeout=30,
            what="2 in flight",
        )
        loads = [w["requestsInFlight"] for w in describe(mgmt, f"/models/{MODEL}/1.0")[0]["workers"]]
    finally:
        for pid in pids:
            os.kill(pid, signal.SIGCONT)
    for t in threads:
        t.join(120)
    assert loads == [1, 1]
    assert [r.status for r in results] == [200, 200]

    r = mgmt.put("management", f"/models/{MODEL}/1.0?min_worker=1")  # asynchronous
    assert r.status == 202 and r.json() == {"status": "Processing worker updates..."}
    mgmt.wait_for(lambda: len(describe(mgmt, f"/models/{MODEL}/1.0")[0]["workers"]) == 1, what="scaled down to 1")
    [desc] = describe(mgmt, f"/models/{MODEL}/1.0")
    [kept] = ready_pids(desc)
    [gone] = set(pids) - {kept}
    mgmt.wait_for(lambda: not alive(gone), timeout=30, what="removed worker exits")
    assert desc["minWorkers"] == 1
    assert mgmt.predict(MODEL, "1.0").status == 200

    assert mgmt.put("management", f"/models/{MODEL}/1.0?min_worker=3&max_worker=2").status == 400
    assert mgmt.put("management", f"/models/{MODEL}/9.9?min_worker=1").status == 404
    assert mgmt.put("management", "/models/nope?min_worker=1").status == 404


def test_set_default_routes_unversioned_requests(mgmt):
    r = mgmt.put("management", f"/models/{MODEL}/2.0/set-default")
    assert r.status == 200, r.text
    assert r.json() == {"status": f'Default version successfully updated for model "{MODEL}" to "2.0"'}
    [desc] = describe(mgmt)
    assert desc["modelVersion"] == "2.0" and desc["isDefault"]
    # With version 1.0 at zero workers, only 2.0 can answer an unversioned request.
    r = mgmt.put("management", f"/models/{MODEL}/1.0?min_worker=0&synchronous=true")
    assert r.status == 200, r.text
    assert mgmt.predict(MODEL).status == 200
    # ... and a request for 1.0 itself loads a worker for it on demand (minWorkers 0).
    assert not describe(mgmt, f"/models/{MODEL}/1.0")[0]["workers"]
    r = mgmt.predict(MODEL, "1.0")
    assert r.status == 200, r.text
    assert mgmt.put("management", f"/models/{MODEL}/7.0/set-default").status == 404


def test_snapshot_follows_every_change(mgmt):
    assert {(m["name"], m["version"], m["url"], m["min_workers"], m["default"]) for m in snapshot_models(mgmt)} == {
        ("another", "1.0", ARCHIVE, 0, True),
        (MODEL, "1.0", ARCHIVE, 0, False),
        (MODEL, "2.0", TINY_ARCHIVE_V2, 1, True),
    }


def test_unregister(mgmt):
    r = mgmt.delete("management", f"/models/{MODEL}/2.0")  # the default, with 1.0 still there
    assert r.status == 403, r.text
    [desc] = describe(mgmt, f"/models/{MODEL}/2.0")
    pid = ready_pids(desc)[0]
    assert mgmt.put("management", f"/models/{MODEL}/1.0/set-default").status == 200
    r = mgmt.delete("management", f"/models/{MODEL}/2.0")
    assert r.status == 200, r.text
    assert "unregistered" in r.json()["status"]
    mgmt.wait_for(lambda: not alive(pid), timeout=30, what="worker of 2.0 exits")
    assert mgmt.get("management", f"/models/{MODEL}/2.0").status == 404
    assert mgmt.predict(MODEL, "2.0").status == 404
    assert mgmt.delete("management", f"/models/{MODEL}").status == 200
    assert mgmt.delete("management", "/models/another").status == 200
    r = mgmt.get("management", f"/models/{MODEL}")
    assert r.status == 404 and r.json()["code"] == 404
    assert mgmt.delete("management", f"/models/{MODEL}").status == 404
    assert mgmt.get("management", "/models").json() == {"models": []}
    assert snapshot_models(mgmt) == []


def test_unknown_route_is_a_json_404(mgmt):
    r = mgmt.get("management", "/nothing/here")
    assert r.status == 404 and r.json()["code"] == 404
