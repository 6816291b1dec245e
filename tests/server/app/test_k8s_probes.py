"""The Kubernetes manifests' probes against a server where one of two models crash-loops (issue
34): the liveness (and startup) probe stays 200, so the pod is not killed for one bad model;
the readiness probe is 503 and its body names the model that cannot serve."""

from __future__ import annotations

import time
from pathlib import Path

import pytest
import yaml

from tests.server.conftest import TINY

DEPLOYMENT = Path(__file__).resolve().parents[3] / "config/deploy/kubernetes/deployment.yaml"
# The engine refuses to start: a KV pool of 2 blocks cannot hold max_model_len 256.
CRASHING_CONFIG = "startupTimeout: 20\nminWorkers: 1\nhandler:\n  max_model_len: 256\n  num_kv_blocks: 2\n"


def _probes() -> dict[str, str]:
    container = yaml.safe_load(DEPLOYMENT.read_text())["spec"]["template"]["spec"]["containers"][0]
    return {kind: container[f"{kind}Probe"]["httpGet"]["path"] for kind in ("startup", "liveness", "readiness")}


@pytest.fixture(scope="module")
def crashing_archive(tiny_store, tiny_model, tmp_path_factory) -> str:
    from pagedserve.engine.model.archive import write_archive

    config = tmp_path_factory.mktemp("crashing") / "model-config.yaml"
    config.write_text(CRASHING_CONFIG)
    write_archive(
        tiny_model, tiny_store / "crashing", model_name="crashing", version="1.0", config_file=config, force=True
    )
    return "crashing/crashing.mar"


def test_liveness_stays_200_while_one_of_two_models_crash_loops(inprocess_factory, crashing_archive):
    probes = _probes()
    server = inprocess_factory(load_models=[f"{TINY}={TINY}.mar"], enable_model_api=True)
    assert {server.get("inference", p).status for p in probes.values()} == {200}
    r = server.post("management", f"/models?url={crashing_archive}&synchronous=false&initial_workers=1")
    assert r.status == 202, r.text
    # its worker fails, is restarted with back-off, fails again: watch it for a while
    deadline = time.monotonic() + 30
    restarts_seen = False
    while time.monotonic() < deadline:
        assert server.get("inference", probes["liveness"]).status == 200
        assert server.get("inference", probes["startup"]).status == 200
        ready = server.get("inference", probes["readiness"])
        assert ready.status == 503 and ready.json()["notReady"] == ["crashing 1.0"], ready.text
        [desc] = server.get("management", "/models/crashing").json()
        restarts_seen = restarts_seen or any(w.get("lastError") for w in desc["workers"])
        if restarts_seen:
            break
        time.sleep(0.5)
    assert restarts_seen, desc
    assert server.get("inference", "/ping").status == 500  # TorchServe's health check says so too
    assert server.predict(TINY).status == 200  # the good model serves on
