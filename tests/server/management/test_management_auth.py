"""Token authorization on the management port (every route: no token, a wrong token, the right
one), the key file, the metrics port without a token, --disable-token-auth, and 405 for
registration while the model API is off. In-process, on the tiny model."""

from __future__ import annotations

import json
import stat
from pathlib import Path

import pytest

from tests.server.conftest import TINY as MODEL
from tests.server.conftest import TINY_ARCHIVE as ARCHIVE


@pytest.fixture(scope="module")
def server(inprocess_factory):
    return inprocess_factory(load_models=[f"{MODEL}={ARCHIVE}"])


# (method, path, status with the right token) while the model API is off: register and
# unregister answer 405 once authorized.
ROUTES = [
    ("GET", "/models", 200),
    ("POST", f"/models?url={ARCHIVE}&model_name=x", 405),
    ("GET", f"/models/{MODEL}", 200),
    ("GET", f"/models/{MODEL}/all", 200),
    ("GET", f"/models/{MODEL}/1.0", 200),
    ("PUT", f"/models/{MODEL}?min_worker=1&synchronous=true", 200),
    ("PUT", f"/models/{MODEL}/1.0?min_worker=1&synchronous=true", 200),
    ("PUT", f"/models/{MODEL}/1.0/set-default", 200),
    ("DELETE", f"/models/{MODEL}/1.0", 405),
    ("DELETE", f"/models/{MODEL}", 405),
]


@pytest.mark.parametrize("method, path, ok_status", ROUTES)
def test_every_management_route_needs_the_management_key(server, method, path, ok_status):
    for token in (None, "wrong-token", server.keys["inference"]):
        r = server.request(method, "management", path, token=token)
        assert r.status == 401, (method, path, token, r.text)
        body = r.json()
        assert body["code"] == 401 and body["type"] and "Token" in body["message"]
    r = server.request(method, "management", path, headers={"Authorization": "Basic abc"}, token=None)
    assert r.status == 401
    r = server.request(method, "management", path)  # the right key
    assert r.status == ok_status, (method, path, r.text)


def test_model_api_off_answers_405_and_changes_nothing(server):
    r = server.post("management", "/models", json={"url": ARCHIVE, "model_name": "x"})
    assert r.status == 405
    body = r.json()
    assert body["code"] == 405 and "--enable-model-api" in body["message"]
    assert server.delete("management", f"/models/{MODEL}").status == 405
    assert [m["modelName"] for m in server.get("management", "/models").json()["models"]] == [MODEL]
    assert server.predict(MODEL).status == 200


def test_key_file_shape_and_mode(server):
    path = Path(server.config.key_file)
    assert stat.S_IMODE(path.stat().st_mode) == 0o600
    data = json.loads(path.read_text())
    assert set(data) == {"management", "inference"}
    assert data["management"]["key"] != data["inference"]["key"]
    assert all(len(data[k]["key"]) >= 24 for k in data)
    assert "key_file.json" in server.log_text()  # printed at start


def test_metrics_need_no_token(server):
    r = server.get("metrics", "/metrics")
    assert r.status == 200
    assert "pagedserve_kv_blocks_free" in r.text


def test_disable_token_auth(inprocess_factory):
    s = inprocess_factory(disable_token_auth=True, enable_model_api=True)
    assert not Path(s.config.key_file).exists()
    assert s.get("management", "/models", token=None).status == 200
    assert s.get("management", "/models", token="anything").status == 200
    assert s.get("inference", "/ping", token=None).status == 200
    assert "authorization is OFF" in s.log_text()
