"""LoRA adapters on the server: `pagedserve archive --lora-dir`, registration onto the base
version's workers (no new process), refusal for other base weights, /v1/models with `parent`,
GET /models/{adapter}, requests naming the adapter as the model (/predictions and OpenAI), and
unregistering mid-stream (the DELETE waits, the stream finishes).

One in-process server over a store holding the tiny model and adapters made here with peft."""

from __future__ import annotations

import http.client
import json
import re
import shutil
import threading

import pytest
import torch

from tests.server.conftest import TINY, TINY_ARCHIVE

ADAPTER = "tiny-lora"


@pytest.fixture(scope="module")
def lora_store(tmp_path_factory, tiny_store, tiny_model):
    """A store with tiny.mar, tiny-lora.mar (made with the CLI) and other-base.mar (pinned to
    other weights)."""
    from peft import LoraConfig, get_peft_model
    from transformers import LlamaForCausalLM

    from pagedserve.engine.model.archive import write_archive
    from pagedserve.server.cli import main

    store = tmp_path_factory.mktemp("lora_store")
    shutil.copy(tiny_store / TINY_ARCHIVE, store / TINY_ARCHIVE)
    torch.manual_seed(5)
    model = get_peft_model(
        LlamaForCausalLM.from_pretrained(tiny_model),
        LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj", "down_proj"], init_lora_weights=False),
    )
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "lora_" in name:
                p.normal_(0, 1.0)
    adapter_dir = tmp_path_factory.mktemp("peft") / "adapter"
    model.save_pretrained(adapter_dir)
    assert (
        main(
            [
                "archive",
                "--lora-dir",
                str(adapter_dir),
                "--base-model",
                f"{TINY}:1.0",
                "--model-name",
                ADAPTER,
                "--version",
                "1.0",
                "--export-path",
                str(store),
            ]
        )
        == 0
    )
    record = {"baseModel": TINY, "baseVersion": None, "baseWeightsSha256": "0" * 64, "rank": 4}
    write_archive(adapter_dir, store, model_name="other-base", version="1.0", lora=record)
    return store


@pytest.fixture(scope="module")
def srv(inprocess_factory, lora_store):
    return inprocess_factory(model_store=str(lora_store), load_models=[f"{TINY}={TINY_ARCHIVE}"], enable_model_api=True)


@pytest.fixture(scope="module")
def registered(srv):
    workers = srv.state.registry.resolve(TINY).pool.size
    reply = srv.post("management", f"/models?url={ADAPTER}.mar")
    assert reply.status == 200, reply.text
    assert f'registered on model "{TINY}"' in reply.json()["status"]
    assert srv.state.registry.resolve(TINY).pool.size == workers  # no worker of its own
    return ADAPTER


def test_archive_manifest_pins_the_base(lora_store):
    from pagedserve.engine.model.lora_archive import find_base_manifest, read_manifest, weights_digest

    model = read_manifest(lora_store / f"{ADAPTER}.mar")["model"]
    base = find_base_manifest(lora_store, TINY, "1.0")
    assert model["lora"]["baseModel"] == TINY and model["lora"]["baseVersion"] == "1.0"
    assert model["lora"]["baseWeightsSha256"] == weights_digest(base["files"])
    assert model["lora"]["rank"] == 4 and model["serializedFile"] == "adapter_model.safetensors"


def test_archive_cli_refuses_an_unknown_base(lora_store, tmp_path, capsys):
    from pagedserve.server.cli import main

    assert (
        main(
            [
                "archive",
                "--lora-dir",
                str(tmp_path),
                "--base-model",
                "nope",
                "--model-name",
                "x",
                "--version",
                "1",
                "--export-path",
                str(lora_store),
            ]
        )
        != 0
    )
    assert "no archive of base model 'nope'" in capsys.readouterr().err


def test_registering_for_other_weights_is_refused(srv):
    reply = srv.post("management", "/models?url=other-base.mar")
    assert reply.status == 400
    assert "was made for other weights than model 'tiny'" in reply.text
    assert srv.get("management", "/models/other-base").status == 404


def test_adapter_is_listed_and_described(srv, registered):
    models = srv.get("inference", "/v1/models").json()["data"]
    entry = next(m for m in models if m["id"] == registered)
    assert entry["parent"] == TINY and entry["root"] == registered
    assert srv.get("inference", f"/v1/models/{registered}").json()["parent"] == TINY
    (described,) = srv.get("management", f"/models/{registered}").json()
    assert described["adapter"] is True and described["parent"] == TINY and described["rank"] == 4
    listed = srv.get("management", "/models").json()["models"]
    assert {"modelName": registered, "modelUrl": f"{registered}.mar", "parent": TINY} in listed
    assert srv.post("management", f"/models?url={registered}.mar").status == 409  # registered already


def test_requests_name_the_adapter_as_the_model(srv, registered):
    base = srv.predict(TINY, max_tokens=8).json()["choices"][0]["token_ids"]
    tuned = srv.predict(registered, max_tokens=8).json()["choices"][0]["token_ids"]
    assert tuned != base
    reply = srv.post(
        "inference",
        "/v1/completions",
        json={"model": registered, "prompt": "1, 2, 3, 4,", "max_tokens": 8, "temperature": 0},
    )
    assert reply.status == 200 and reply.json()["model"] == registered
    assert srv.predict(registered, max_tokens=8).json()["choices"][0]["token_ids"] == tuned
    assert srv.predict(TINY, max_tokens=8).json()["choices"][0]["token_ids"] == base


def test_unregister_mid_stream_lets_the_stream_finish(srv, lora_store):
    name = "tiny-lora-2"
    assert srv.post("management", f"/models?url={ADAPTER}.mar&model_name={name}").status == 200
    adapter = srv.state.adapters.get(name)
    conn = http.client.HTTPConnection("127.0.0.1", srv.ports["inference"], timeout=120)
    body = {"prompt": "1, 2, 3,", "max_tokens": 200, "temperature": 0, "ignore_eos": True, "stream": True}
    conn.request("POST", f"/predictions/{name}", json.dumps(body), srv.auth_headers("inference"))
    resp = conn.getresponse()
    first = resp.readline()
    assert resp.status == 200 and json.loads(first)
    assert adapter.in_flight == 1  # 200 tokens: still generating when the DELETE goes out
    seen_after_delete = []
    deleted = threading.Thread(
        target=lambda: seen_after_delete.append((srv.delete("management", f"/models/{name}"), adapter.in_flight))
    )
    deleted.start()
    rest = resp.read().splitlines()
    deleted.join(120)
    conn.close()
    reply, in_flight_when_answered = seen_after_delete[0]
    assert reply.status == 200 and "unregistered" in reply.text
    assert in_flight_when_answered == 0  # the DELETE answered only once the stream was done
    last = json.loads(rest[-1])
    tokens = sum(len(json.loads(line)["choices"][0].get("token_ids", [])) for line in [first, *rest])
    assert last["choices"][0]["finish_reason"] == "length" and tokens == 200
    assert srv.predict(name).status == 404  # gone for new requests


def test_structured_output_with_an_adapter(srv, registered):
    """The grammar's mask applies to the adapter's logits like to the base model's."""
    body = {
        "prompt": "Answer:",
        "max_tokens": 12,
        "temperature": 0,
        "structured_outputs": {"regex": "(red|green|blue)-[0-9]{3}"},
    }
    for model in (registered, TINY):
        reply = srv.post("inference", f"/predictions/{model}", json=body)
        assert reply.status == 200, reply.text
        text = reply.json()["choices"][0]["text"]
        assert re.fullmatch(r"(red|green|blue)-[0-9]{3}", text), (model, text)


def test_a_base_with_adapters_cannot_be_unregistered(srv, registered):
    reply = srv.delete("management", f"/models/{TINY}")
    assert reply.status == 403 and registered in reply.text
    assert srv.predict(registered).status == 200
