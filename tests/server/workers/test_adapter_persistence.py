"""LoRA adapters beyond the management API (issue 34): they are kept in the snapshot and come
back on their base after a restart, they can be given with --models (load_models), and the
KServe routes reach them by name."""

from __future__ import annotations

import pytest

from tests.server.conftest import TINY, TINY_ARCHIVE
from tests.server.workers.test_lora_server import ADAPTER, lora_store  # noqa: F401 (a fixture)

PROMPT = "1, 2, 3, 4,"


def _v2_infer(srv, model: str) -> str:
    r = srv.post(
        "inference",
        f"/v2/models/{model}/infer",
        json={
            "inputs": [{"name": "text_input", "shape": [1], "datatype": "BYTES", "data": [PROMPT]}],
            "parameters": {"max_tokens": 8, "temperature": 0},
        },
    )
    assert r.status == 200, r.text
    assert r.json()["model_name"] == model
    return r.json()["outputs"][0]["data"][0]


def _predict_text(srv, model: str) -> str:
    r = srv.predict(model, prompt=PROMPT, max_tokens=8)
    assert r.status == 200, r.text
    return r.json()["choices"][0]["text"]


@pytest.fixture(scope="module")
def snapshot(tmp_path_factory):
    return tmp_path_factory.mktemp("adapter-snapshot") / "snapshot.json"


def test_an_adapter_survives_a_snapshot_restart_and_is_reachable_over_kserve(inprocess_factory, lora_store, snapshot):  # noqa: F811
    first = inprocess_factory(
        model_store=str(lora_store),
        load_models=[f"{TINY}={TINY_ARCHIVE}"],
        enable_model_api=True,
        snapshot_path=str(snapshot),
    )
    assert first.post("management", f"/models?url={ADAPTER}.mar").status == 200
    tuned = _predict_text(first, ADAPTER)
    assert tuned != _predict_text(first, TINY)
    assert _v2_infer(first, ADAPTER) == tuned
    first.stop()
    assert '"adapters"' in snapshot.read_text() and ADAPTER in snapshot.read_text()

    second = inprocess_factory(model_store=str(lora_store), enable_model_api=True, snapshot_path=str(snapshot))
    second.wait_for(lambda: second.state.adapters.get(ADAPTER) is not None, 60, what="the adapter back")
    (described,) = second.get("management", f"/models/{ADAPTER}").json()
    assert described["adapter"] is True and described["parent"] == TINY
    assert _predict_text(second, ADAPTER) == tuned
    assert _v2_infer(second, ADAPTER) == tuned
    assert second.get("inference", f"/v2/models/{ADAPTER}/ready").status == 200
    # unregistered: gone from the snapshot too
    assert second.delete("management", f"/models/{ADAPTER}").status == 200
    assert ADAPTER not in snapshot.read_text()


def test_an_adapter_given_with_models_is_registered_on_its_base(inprocess_factory, lora_store):  # noqa: F811
    srv = inprocess_factory(
        model_store=str(lora_store), load_models=[f"{ADAPTER}={ADAPTER}.mar", f"{TINY}={TINY_ARCHIVE}"]
    )
    srv.wait_for(lambda: srv.state.adapters.get(ADAPTER) is not None, 60, what="the adapter")
    assert srv.state.adapters.get(ADAPTER).base.name == TINY
    assert _v2_infer(srv, ADAPTER) == _predict_text(srv, ADAPTER) != _predict_text(srv, TINY)
