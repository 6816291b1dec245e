"""What TorchServe clients send, in-process on the tiny model: /predictions as a PUT with a raw
body (`curl -T`), plain text, multipart and url-encoded forms, `max_new_tokens`, and the
refusals of hostile bodies; the register parameters TorchServe documents; an archive made for
TorchServe's `vllm_handler` (folder layout, model-config with `vllm_engine_config`) registering
and serving."""

from __future__ import annotations

import json
import logging
import shutil
import subprocess
from pathlib import Path

import pytest
import yaml

from tests.server.conftest import TINY, TINY_ARCHIVE

GREEDY = {"prompt": "1, 2, 3,", "max_tokens": 4, "temperature": 0}
VLLM_MODEL_CONFIG = {
    "minWorkers": 1,
    "maxWorkers": 1,
    "maxBatchDelay": 100,
    "startupTimeout": 300,
    "asyncCommunication": True,
    "handler": {
        "model_path": "model/models--org--tiny/snapshots/0123abc",
        "vllm_engine_config": {
            "max_num_seqs": 8,
            "max_model_len": 128,
            "dtype": "float",
            "served_model_name": ["org/tiny"],
            "gpu_memory_utilization": 0.9,
            "enable_lora": True,
        },
    },
}


@pytest.fixture(scope="module")
def store(tiny_store, tiny_model, tmp_path_factory) -> Path:
    """tiny.mar, and `vllm-tiny/`: the tiny model as torch-model-archiver lays out a vLLM
    archive (`--handler vllm_handler --archive-format no-archive`, the model under model/)."""
    store = tmp_path_factory.mktemp("ts_store")
    shutil.copy(tiny_store / TINY_ARCHIVE, store / TINY_ARCHIVE)
    folder = store / "vllm-tiny"
    shutil.copytree(tiny_model, folder / VLLM_MODEL_CONFIG["handler"]["model_path"])
    (folder / "MAR-INF").mkdir()
    (folder / "MAR-INF" / "MANIFEST.json").write_text(
        json.dumps(
            {
                "createdOn": "01/12/2026 00:00:00",
                "runtime": "python",
                "archiverVersion": "0.12.0",
                "model": {
                    "modelName": "vllm-tiny",
                    "handler": "vllm_handler",
                    "modelVersion": "1.0",
                    "configFile": "model-config.yaml",
                },
            }
        )
    )
    (folder / "model-config.yaml").write_text(yaml.safe_dump(VLLM_MODEL_CONFIG))
    return store


@pytest.fixture(scope="module")
def server(inprocess_factory, store):
    return inprocess_factory(
        model_store=str(store), load_models=[f"{TINY}={TINY_ARCHIVE}"], enable_model_api=True, max_request_size=1 << 20
    )


def send(
    server, body: bytes, content_type: str | None = None, method: str = "POST", path: str = f"/predictions/{TINY}"
):
    headers = {"Content-Type": content_type} if content_type else {}
    return server.request(method, "inference", path, data=body, headers=headers)


def multipart(*parts: tuple[str | None, bytes], boundary: str = "b0undary") -> tuple[bytes, str]:
    out = b""
    for name, value in parts:
        disposition = "form-data" + (f'; name="{name}"' if name else "")
        out += (f"--{boundary}\r\nContent-Disposition: {disposition}\r\n\r\n").encode() + value + b"\r\n"
    return out + f"--{boundary}--\r\n".encode(), f"multipart/form-data; boundary={boundary}"


def text_of(r) -> str:
    assert r.status == 200, r.text
    return r.json()["choices"][0]["text"]


# -- /predictions bodies -----------------------------------------------------------------------


def test_json_body_and_max_new_tokens(server):
    expected = text_of(server.post("inference", f"/predictions/{TINY}", json=GREEDY))
    body = {**GREEDY, "max_new_tokens": 4}
    del body["max_tokens"]
    r = server.post("inference", f"/predictions/{TINY}", json=body)
    assert text_of(r) == expected and r.json()["usage"]["completion_tokens"] == 4
    r = server.post("inference", f"/predictions/{TINY}", json={**GREEDY, "max_new_tokens": 4})
    assert r.status == 400 and "max_new_tokens" in r.json()["message"]


def test_put_with_a_raw_body_as_curl_upload_file_sends_it(server):
    """`curl -T prompt.txt` / `curl -T request.json`: a PUT, no Content-Type, Expect: 100-continue."""
    headers = {"Expect": "100-continue"}
    r = server.request("PUT", "inference", f"/predictions/{TINY}", data=json.dumps(GREEDY).encode(), headers=headers)
    expected = text_of(server.post("inference", f"/predictions/{TINY}", json=GREEDY))
    assert text_of(r) == expected
    r = server.request("PUT", "inference", f"/predictions/{TINY}/1.0", data=b"Once upon a time", headers=headers)
    assert r.status == 200 and r.json()["usage"]["prompt_tokens"] == len(
        server.state.registry.resolve(TINY).tokenizer.encode("Once upon a time")
    )


@pytest.mark.skipif(shutil.which("curl") is None, reason="needs the curl command")
def test_the_curl_commands_torchserve_documents(server, tmp_path):
    """`curl -T file`, `curl -F data=@file`, `curl -d text`, exactly as a user types them."""
    expected = text_of(server.post("inference", f"/predictions/{TINY}", json=GREEDY))
    (tmp_path / "request.json").write_text(json.dumps(GREEDY))
    (tmp_path / "prompt.txt").write_text("Once upon a time")
    url = server.url("inference", f"/predictions/{TINY}")
    auth = ["-H", f"Authorization: Bearer {server.keys['inference']}"]

    def curl(*args: str) -> dict:
        out = subprocess.run(
            ["curl", "-sS", "--fail-with-body", *auth, url, *args],
            cwd=tmp_path,
            capture_output=True,
            text=True,
            timeout=120,
            check=False,
        )
        assert out.returncode == 0, out.stdout + out.stderr
        return json.loads(out.stdout)

    assert curl("-T", "request.json")["choices"][0]["text"] == expected
    assert curl("-F", "data=@request.json")["choices"][0]["text"] == expected
    assert curl("-d", "@request.json")["choices"][0]["text"] == expected
    prompt_tokens = {
        curl("-T", "prompt.txt")["usage"]["prompt_tokens"],
        curl("-F", "data=@prompt.txt")["usage"]["prompt_tokens"],
        curl("-d", "Once upon a time")["usage"]["prompt_tokens"],
    }
    assert prompt_tokens == {len(server.state.registry.resolve(TINY).tokenizer.encode("Once upon a time"))}


def test_plain_text_body_is_the_prompt(server):
    expected = text_of(server.post("inference", f"/predictions/{TINY}", json=GREEDY))
    assert text_of(send(server, json.dumps(GREEDY).encode(), "text/plain")) == expected  # fetch()'s type
    r = send(server, b'{not json, a prompt', "text/plain")
    assert r.status == 200, r.text
    r = send(server, "Grüße, 1, 2".encode(), "text/plain; charset=utf-8")
    assert r.status == 200 and r.json()["choices"][0]["finish_reason"] in ("length", "stop")
    assert (
        send(server, b"\xff\xfe not utf-8", "text/plain").json()["message"].startswith("the request body is not UTF-8")
    )
    for empty in (b"", b"  \n"):
        r = send(server, empty, "text/plain")
        assert r.status == 400 and "empty" in r.json()["message"]


def test_multipart_form_data(server):
    expected = text_of(server.post("inference", f"/predictions/{TINY}", json=GREEDY))
    body, kind = multipart(("data", json.dumps(GREEDY).encode()))  # curl -F "data=@request.json"
    assert text_of(send(server, body, kind)) == expected
    body, kind = multipart(("prompt", b"1, 2, 3,"), ("max_new_tokens", b"4"), ("temperature", b"0"))
    assert text_of(send(server, body, kind)) == expected
    body, kind = multipart(("body", b"plain prompt text"))
    assert send(server, body, kind).status == 200
    r = send(server, b"prompt=1%2C+2%2C+3%2C&max_new_tokens=4&temperature=0", "application/x-www-form-urlencoded")
    assert text_of(r) == expected


@pytest.mark.parametrize(
    "case, body, kind, status, words",
    [
        ("no boundary", b"--x\r\n\r\n", "multipart/form-data", 400, "boundary"),
        ("non-ASCII boundary", b"--\xe9\r\n", "multipart/form-data; boundary=\xe9", 400, "ASCII"),
        ("no parts", b"just text, no delimiters", "multipart/form-data; boundary=zz", 400, "no parts"),
        ("unnamed part", *multipart((None, b"x")), 400, "no name"),
        (
            "cut short",
            b"--zz\r\nContent-Disposition: form-data; name=data\r\n\r\nhi",
            "multipart/form-data; boundary=zz",
            400,
            "cut short",
        ),
        ("no header block", b"--zz\r\nhi\r\n--zz--", "multipart/form-data; boundary=zz", 400, "no header block"),
        ("too many parts", *multipart(*[(f"f{i}", b"1") for i in range(65)]), 400, "more than 64"),
        ("input plus fields", *multipart(("data", b"hi"), ("temperature", b"0")), 400, "belong inside"),
        ("no input field", *multipart(("temperature", b"0")), 400, "no input"),
        ("bad field value", *multipart(("prompt", b"x"), ("max_new_tokens", b"0")), 400, "max_tokens"),
        ("unknown field", *multipart(("prompt", b"x"), ("bogus", b"1")), 400, "bogus"),
        ("binary part", *multipart(("data", b"\xff\xfe\xfd")), 400, "not UTF-8"),
        ("huge part", *multipart(("data", b"x" * (1 << 20))), 413, "max_request_size"),
        ("url-encoded, binary", b"data=%ff%fe", "application/x-www-form-urlencoded", 400, "not UTF-8"),
        ("bad json", b'{"prompt": ', "application/json", 400, "not valid JSON"),
        ("json in octet-stream", b'{"prompt": 1.5}', "application/octet-stream", 400, "prompt"),
    ],
)
def test_hostile_bodies_are_4xx_naming_the_problem(server, case, body, kind, status, words):
    r = send(server, body, kind)
    assert r.status == status, (case, r.status, r.text)
    assert words in r.json()["message"], (case, r.text)


# -- registration ------------------------------------------------------------------------------


def register(server, query: str):
    return server.post("management", f"/models?url={TINY_ARCHIVE}&initial_workers=0&synchronous=true&{query}")


def test_register_parameters_torchserve_documents(server):
    r = register(
        server, "model_name=p1&startup_timeout=600&max_batch_delay=100&batch_size=1&runtime=python&handler=llm"
    )
    assert r.status == 200, r.text
    [described] = server.get("management", "/models/p1").json()
    assert described["startupTimeout"] == 600
    for query, param, words in (
        ("model_name=p2&batch_size=4", "batch_size", "continuously"),
        ("model_name=p2&runtime=java", "runtime", "Python archives only"),
        ("model_name=p2&handler=my_handler.py", "handler", "archive's handler"),
        ("model_name=p2&startup_timeout=0", "startup_timeout", ">= 1"),
    ):
        r = register(server, query)
        assert r.status == 400 and param in r.json()["message"] and words in r.json()["message"], r.text
    assert "p2" not in server.state.registry.models


def test_a_vllm_handler_archive_registers_and_serves(server, caplog):
    with caplog.at_level(logging.WARNING):
        r = server.post("management", "/models?url=vllm-tiny&initial_workers=1&synchronous=true&handler=vllm_handler")
    assert r.status == 200, r.text
    warned = caplog.text
    for key in (
        "maxBatchDelay",
        "asyncCommunication",
        "vllm_engine_config.gpu_memory_utilization",
        "vllm_engine_config.enable_lora",
    ):
        assert key in warned, key
    assert "served_model_name" not in warned and "model_path" not in warned  # understood
    version = server.state.registry.resolve("vllm-tiny")
    assert version.model_config.engine_options() == {"max_num_seqs": 8, "max_model_len": 128, "dtype": "float32"}
    [described] = server.get("management", "/models/vllm-tiny").json()
    assert described["maxModelLen"] == 128 and described["startupTimeout"] == 300
    r = server.post("inference", "/predictions/vllm-tiny", json={"prompt": "1, 2,", "max_new_tokens": 3})
    assert r.status == 200 and r.json()["usage"]["completion_tokens"] == 3, r.text
    r = server.post("inference", "/predictions/vllm-tiny", json={"prompt": "x", "max_tokens": 200})
    assert r.status == 400 and "128" in r.json()["message"], r.text  # max_model_len from vllm_engine_config
