"""Restart and shutdown of a real server: the snapshot brings registrations back; SIGTERM
drains (new requests get 503, in-flight ones finish, exit 0) and aborts what outlives the
grace period."""

from __future__ import annotations

import signal
import threading

import pytest

from tests.server.conftest import ARCHIVE, MODEL

pytestmark = pytest.mark.slow


def test_snapshot_restores_registrations_across_a_restart(server_factory, archive_v2, tmp_path):
    workdir = tmp_path / "srv"
    a = server_factory(args=["--enable-model-api"], workdir=workdir)
    assert a.post("management", f"/models?url={ARCHIVE}&synchronous=true").status == 200
    assert a.put("management", f"/models/{MODEL}/1.0?min_worker=1&max_worker=3").status == 202
    r = a.post("management", f"/models?url={archive_v2}&initial_workers=0")
    assert r.status == 200, r.text
    assert a.put("management", f"/models/{MODEL}/2.0/set-default").status == 200
    assert a.stop() == 0

    b = server_factory(workdir=workdir)  # no --models: everything comes from the snapshot
    versions = b.get("management", f"/models/{MODEL}/all").json()
    assert [(d["modelVersion"], d["minWorkers"], d["maxWorkers"], d["isDefault"]) for d in versions] == [
        ("1.0", 1, 3, False),
        ("2.0", 0, 4, True),
    ]
    assert all(d["loadedAtStartup"] for d in versions)
    assert [w["status"] for w in versions[0]["workers"]] == ["READY"]
    assert b.predict(MODEL, "1.0").status == 200
    assert b.stop() == 0

    c = server_factory(workdir=workdir, args=["--ncs"])  # snapshot not restored
    assert c.get("management", "/models").json() == {"models": []}


def _long_request(server, results, max_tokens):
    try:
        results.append(
            server.post(
                "inference",
                f"/predictions/{MODEL}",
                json={"prompt": "Count: 1, 2, 3,", "max_tokens": max_tokens, "temperature": 0, "ignore_eos": True},
                timeout=300,
            )
        )
    except OSError as exc:  # connection closed by the server
        results.append(exc)


def _start_in_flight(server, max_tokens):
    results: list = []
    thread = threading.Thread(target=_long_request, args=(server, results, max_tokens))
    thread.start()
    server.wait_for(
        lambda: server.get("management", f"/models/{MODEL}").json()[0]["workers"][0]["requestsInFlight"] == 1,
        timeout=30,
        what="request in flight",
    )
    return thread, results


def test_sigterm_drains_in_flight_requests_and_exits_0(server_factory):
    s = server_factory(models=[f"{MODEL}={ARCHIVE}"], env={"PAGEDSERVE_DRAIN_GRACE": "120"})
    thread, results = _start_in_flight(s, max_tokens=48)
    s.proc.send_signal(signal.SIGTERM)
    s.wait_for(lambda: s.get("inference", "/live").status == 503, timeout=30, what="draining")
    refused = s.predict(MODEL)  # new requests are refused while draining
    assert refused.status == 503, refused.text
    assert "shutting down" in refused.json()["message"]
    thread.join(120)
    [done] = results
    assert not isinstance(done, Exception) and done.status == 200, done
    assert len(done.json()["choices"][0]["token_ids"]) == 48
    assert s.proc.wait(60) == 0
    assert "draining" in s.log_text()


def test_sigterm_aborts_what_outlives_the_grace_period(server_factory):
    s = server_factory(models=[f"{MODEL}={ARCHIVE}"], env={"PAGEDSERVE_DRAIN_GRACE": "1"})
    thread, results = _start_in_flight(s, max_tokens=1900)  # minutes of decoding
    [w] = s.get("management", f"/models/{MODEL}").json()[0]["workers"]
    s.proc.send_signal(signal.SIGTERM)
    assert s.proc.wait(120) == 0  # after the 1 s grace, not after the minutes of decoding
    thread.join(30)
    [outcome] = results
    assert isinstance(outcome, Exception) or outcome.status >= 500, outcome
    assert "aborting 1 request(s)" in s.log_text()
    with pytest.raises(ProcessLookupError):
        import os

        os.kill(w["pid"], 0)  # the worker is gone too


def test_models_default_archives_the_bundled_model_once(tmp_path):
    """The README's command: `serve --models default` writes model_store/smollm2.mar and serves it."""
    import shutil

    from tests.server.server_process import ServerProcess

    store, extracted = tmp_path / "model_store", tmp_path / "extracted"
    # Its own extraction folder: this archive is new at every run (not the shared test cache's).
    s = ServerProcess(tmp_path / "srv", store, models=["default"], env={"PAGEDSERVE_ARCHIVE_DIR": str(extracted)})
    try:
        s.start()
        assert (store / "smollm2.mar").is_file()
        assert "archiving the bundled model" in s.log_text()
        [desc] = s.get("management", "/models/smollm2").json()
        assert desc["modelUrl"] == "smollm2.mar" and desc["loadedAtStartup"]
        r = s.predict("smollm2")
        assert r.status == 200 and r.json()["choices"][0]["text"]
    finally:
        assert s.stop() == 0
        shutil.rmtree(store, ignore_errors=True)  # 540 MB written by the server: not left in temp
        shutil.rmtree(extracted, ignore_errors=True)
