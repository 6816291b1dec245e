"""KServe's v1 and open-inference v2 protocols on the inference port, in-process on the tiny
model: round trips (text in, text out, the same text /predictions gives), health, readiness and
metadata, `/v1/models/{id}` still OpenAI's, and refusals shaped `{"error": ...}`."""

from __future__ import annotations

import pytest

from tests.server.conftest import TINY

PROMPTS = ["1, 2, 3,", "Once upon a time"]
PARAMS = {"max_tokens": 4, "temperature": 0}


@pytest.fixture(scope="module")
def expected(tiny_server) -> list[str]:
    """What /predictions answers for each prompt, greedy."""
    out = []
    for prompt in PROMPTS:
        r = tiny_server.post("inference", f"/predictions/{TINY}", json={"prompt": prompt, **PARAMS})
        assert r.status == 200, r.text
        out.append(r.json()["choices"][0]["text"])
    return out


def test_v1_predict_round_trip(tiny_server, expected):
    r = tiny_server.post("inference", f"/v1/models/{TINY}:predict", json={"instances": PROMPTS, "parameters": PARAMS})
    assert r.status == 200, r.text
    reply = r.json()
    assert set(reply) == {"predictions", "timings"} and reply["predictions"] == expected
    assert reply["timings"]["total_s"] > 0 and reply["timings"]["decode_s"] is not None  # as elsewhere
    instances = [{"prompt": PROMPTS[0]}, {"text": PROMPTS[1]}]
    r = tiny_server.post(
        "inference",
        f"/v1/models/{TINY}:predict",
        json={"instances": instances, "parameters": {"max_new_tokens": 4, "temperature": 0}},
    )
    assert r.json()["predictions"] == expected
    # /v1/models/{id} is still OpenAI's model route, with KServe v1's model status beside it.
    r = tiny_server.get("inference", f"/v1/models/{TINY}")
    assert r.status == 200 and r.json()["id"] == TINY and r.json()["object"] == "model"
    assert r.json()["name"] == TINY and r.json()["ready"] is True


def test_v2_infer_round_trip(tiny_server, expected):
    body = {
        "id": "req-7",
        "inputs": [{"name": "text_input", "shape": [2], "datatype": "BYTES", "data": PROMPTS}],
        "parameters": PARAMS,
    }
    for path in (f"/v2/models/{TINY}/infer", f"/v2/models/{TINY}/versions/1.0/infer"):
        r = tiny_server.post("inference", path, json=body)
        assert r.status == 200, r.text
        reply = r.json()
        assert reply.pop("timings")["total_s"] > 0
        assert reply == {
            "model_name": TINY,
            "model_version": "1.0",
            "id": "req-7",
            "outputs": [{"name": "text_output", "datatype": "BYTES", "shape": [2], "data": expected}],
        }
    nested = {
        "inputs": [{"name": "x", "shape": [1, 1], "datatype": "BYTES", "data": [[PROMPTS[0]]]}],
        "outputs": [{"name": "generated"}],
        "parameters": PARAMS,
    }
    r = tiny_server.post("inference", f"/v2/models/{TINY}/infer", json=nested)
    assert r.json()["outputs"] == [{"name": "generated", "datatype": "BYTES", "shape": [1], "data": expected[:1]}]


def test_v2_health_readiness_and_metadata(tiny_server):
    assert tiny_server.get("inference", "/v2/health/live").json() == {"live": True}
    assert tiny_server.get("inference", "/v2/health/ready").json() == {"ready": True}
    for path in (f"/v2/models/{TINY}/ready", f"/v2/models/{TINY}/versions/1.0/ready"):
        r = tiny_server.get("inference", path)
        assert r.status == 200 and r.json() == {"name": TINY, "ready": True}
    meta = tiny_server.get("inference", f"/v2/models/{TINY}").json()
    assert meta["name"] == TINY and meta["versions"] == ["1.0"]
    assert meta["inputs"][0]["datatype"] == "BYTES" and meta["outputs"][0]["name"] == "text_output"
    assert tiny_server.get("inference", f"/v2/models/{TINY}/versions/1.0").json()["name"] == TINY
    server_meta = tiny_server.get("inference", "/v2").json()
    assert server_meta["name"] == "pagedserve" and server_meta["extensions"] == []


def _v2(data, **tensor):
    return {"inputs": [{"name": "text_input", "shape": [len(data)], "datatype": "BYTES", "data": data, **tensor}]}


@pytest.mark.parametrize(
    "case, path, body, status, words",
    [
        ("unknown model v1", "/v1/models/nope:predict", {"instances": ["x"]}, 404, "nope"),
        ("unknown model v2", "/v2/models/nope/infer", _v2(["x"]), 404, "nope"),
        ("unknown version", f"/v2/models/{TINY}/versions/9/infer", _v2(["x"]), 404, "9"),
        ("no instances", f"/v1/models/{TINY}:predict", {"parameters": {}}, 400, "instances"),
        ("instance not text", f"/v1/models/{TINY}:predict", {"instances": [{"prompt": 3}]}, 400, "instances[0]"),
        (
            "instance with two keys",
            f"/v1/models/{TINY}:predict",
            {"instances": [{"prompt": "a", "text": "b"}]},
            400,
            "instances[0]",
        ),
        ("unknown v1 field", f"/v1/models/{TINY}:predict", {"instances": ["x"], "inputs": []}, 400, "'inputs'"),
        ("empty instances", f"/v1/models/{TINY}:predict", {"instances": []}, 400, "1 to 32"),
        ("too many", f"/v1/models/{TINY}:predict", {"instances": ["x"] * 33}, 400, "1 to 32"),
        ("n refused", f"/v1/models/{TINY}:predict", {"instances": ["x"], "parameters": {"n": 2}}, 400, "parameters.n"),
        (
            "bad parameter",
            f"/v1/models/{TINY}:predict",
            {"instances": ["x"], "parameters": {"max_tokens": 0}},
            400,
            "parameters.max_tokens",
        ),
        ("unknown parameter", f"/v1/models/{TINY}:predict", {"instances": ["x"], "parameters": {"foo": 1}}, 400, "foo"),
        ("wrong datatype", f"/v2/models/{TINY}/infer", _v2(["x"], datatype="FP32"), 400, "datatype"),
        ("shape mismatch", f"/v2/models/{TINY}/infer", _v2(["x", "y"], shape=[3]), 400, "shape"),
        ("negative shape", f"/v2/models/{TINY}/infer", _v2(["x"], shape=[-1]), 400, "shape"),
        ("numbers as data", f"/v2/models/{TINY}/infer", _v2([1, 2]), 400, "prompt string"),
        ("two inputs", f"/v2/models/{TINY}/infer", {"inputs": _v2(["x"])["inputs"] * 2}, 400, "exactly one"),
        ("unknown tensor field", f"/v2/models/{TINY}/infer", _v2(["x"], foo=1), 400, "foo"),
        ("id not text", f"/v2/models/{TINY}/infer", {**_v2(["x"]), "id": 5}, 400, "id"),
        ("bad outputs", f"/v2/models/{TINY}/infer", {**_v2(["x"]), "outputs": "text"}, 400, "outputs"),
    ],
)
def test_refusals_are_kserve_shaped(tiny_server, case, path, body, status, words):
    r = tiny_server.post("inference", path, json=body)
    assert r.status == status, (case, r.text)
    reply = r.json()
    assert set(reply) == {"error"} and words in reply["error"], (case, reply)


def test_non_json_and_unknown_v2_paths_are_kserve_shaped(tiny_server):
    r = tiny_server.post(
        "inference", f"/v2/models/{TINY}/infer", data=b"[1, 2", headers={"Content-Type": "application/json"}
    )
    assert r.status == 400 and "not valid JSON" in r.json()["error"]
    r = tiny_server.get("inference", "/v2/nothing/here")
    assert r.status == 404 and set(r.json()) == {"error"}
    r = tiny_server.get("inference", f"/v1/models/{TINY}:predict")  # only POST
    assert r.status == 405
    assert tiny_server.post("inference", f"/v2/models/{TINY}/infer", json=_v2(["x"]), token=None).status == 401
