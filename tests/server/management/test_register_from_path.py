"""Registering a model from a path (POST /models?url=<.gguf file or model folder>) and the clear
refusals: an unsupported architecture, rope type, GGUF architecture or GGUF tensor type answers
400 naming it and listing what is supported, before any worker starts; a path outside the
allowed locations 403; a base model's chat 400 naming the missing template unless the
registration supplies one; a model larger than the memory budget 507 naming both sizes.
A real in-process server with real worker processes on a tiny random-weight model."""

from __future__ import annotations

import json
import re
import shutil
from pathlib import Path

import numpy as np
import pytest

TEMPLATE = "{% for m in messages %}<{{ m['role'] }}>{{ m['content'] }}\n{% endfor %}<assistant>"


@pytest.fixture(scope="module")
def paths(tmp_path_factory, tiny_model) -> dict[str, Path]:
    """Model folders and GGUF files in one allowed folder (outside the model store)."""
    root = tmp_path_factory.mktemp("user-models")
    base = root / "tinybase"
    shutil.copytree(tiny_model, base)
    (base / "chat_template.jinja").unlink()  # a base model: no chat template
    out = {"base": base}
    for name, update in {
        "gpt2": {"architectures": ["GPT2LMHeadModel"]},
        "yarn": {"rope_parameters": {"rope_type": "yarn", "factor": 4.0, "rope_theta": 1e4}},
    }.items():
        folder = root / name
        folder.mkdir()
        config = json.loads((tiny_model / "config.json").read_text())
        (folder / "config.json").write_text(json.dumps({**config, **update}))
        out[name] = folder
    out["iq2"] = _gguf(root / "iq2.gguf", "llama", "IQ2_XXS")
    out["bert"] = _gguf(root / "bert.gguf", "bert", "Q8_0")
    out["llama_gguf"] = _gguf(root / "llama.gguf", "llama", "Q8_0")
    return out


def _gguf(path: Path, arch: str, kind: str) -> Path:
    import gguf

    qtype = gguf.GGMLQuantizationType[kind]
    _, nbytes = gguf.GGML_QUANT_SIZES[qtype]
    writer = gguf.GGUFWriter(str(path), arch)
    writer.add_tensor("token_embd.weight", np.zeros((4, nbytes), dtype=np.uint8), raw_dtype=qtype)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


@pytest.fixture(scope="module")
def mgmt(inprocess_factory, paths, tmp_path_factory):
    mp = pytest.MonkeyPatch()
    mp.setenv("PAGEDSERVE_CACHE_DIR", str(tmp_path_factory.mktemp("cache")))  # archives built from paths
    root = re.escape(str(paths["base"].parent.resolve()))
    yield inprocess_factory(enable_model_api=True, allowed_urls=[f"{root}/.*"])
    mp.undo()


def _register(mgmt, path: Path, **extra):
    return mgmt.post("management", "/models", json={"url": str(path), "synchronous": True, **extra})


def _no_worker_started(mgmt) -> None:
    assert mgmt.get("management", "/models").json() == {"models": []}
    assert not mgmt.server.state.registry.all_versions()


@pytest.mark.parametrize(
    "case, message",
    [
        ("gpt2", r"unsupported architecture GPT2LMHeadModel; supported: LlamaForCausalLM, .*Gemma3ForCausalLM"),
        ("yarn", r"unsupported rope type 'yarn'; supported: default, linear, llama3, longrope"),
        ("iq2", r"unsupported GGUF tensor type IQ2_XXS in iq2.gguf; supported: F32, .*Q4_K, Q5_K, Q6_K"),
        ("bert", r"unsupported GGUF architecture 'bert'; supported: llama, .*gemma3"),
    ],
)
def test_unsupported_models_are_refused_naming_them(mgmt, paths, case, message):
    r = _register(mgmt, paths[case])
    assert r.status == 400, r.text
    assert re.search(message, r.json()["message"]), r.json()["message"]
    _no_worker_started(mgmt)


def test_a_path_outside_the_allowed_locations_is_refused(mgmt, paths, tmp_path):
    outside = tmp_path / "elsewhere"
    shutil.copytree(paths["base"], outside)
    r = _register(mgmt, outside)
    assert r.status == 403, r.text
    traversal = f"{paths['base'].parent}/../{outside.parent.name}/elsewhere"
    assert _register(mgmt, Path(traversal)).status == 403
    _no_worker_started(mgmt)


def test_base_model_completes_but_chat_names_the_missing_template(mgmt, paths):
    r = _register(mgmt, paths["base"], model_name="base")
    assert r.status == 200, r.text
    try:
        ok = mgmt.post("inference", "/v1/completions", json={"model": "base", "prompt": "1, 2,", "max_tokens": 3})
        assert ok.status == 200, ok.text
        chat = mgmt.post(
            "inference",
            "/v1/chat/completions",
            json={"model": "base", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 3},
        )
        assert chat.status == 400, chat.text
        assert "has no chat template" in chat.json()["error"]["message"]
        described = mgmt.get("management", "/models/base").json()[0]["model"]
        assert described["architecture"] == "LlamaForCausalLM" and described["source"] == "hf"
    finally:
        assert mgmt.request("DELETE", "management", "/models/base").status == 200


def test_a_registration_can_supply_the_chat_template(mgmt, paths):
    r = _register(mgmt, paths["base"], model_name="chatty", chat_template=TEMPLATE)
    assert r.status == 200, r.text
    try:
        chat = mgmt.post(
            "inference",
            "/v1/chat/completions",
            json={"model": "chatty", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 3},
        )
        assert chat.status == 200, chat.text
    finally:
        assert mgmt.request("DELETE", "management", "/models/chatty").status == 200


def test_the_archive_is_built_once_per_content(mgmt, paths, tmp_path):
    from pagedserve.engine.model.path_source import archive_from_path

    first = archive_from_path(paths["base"])
    copy = tmp_path / "same-content"
    shutil.copytree(paths["base"], copy)
    again = archive_from_path(paths["base"])
    assert again == first and (first / "MAR-INF" / "MANIFEST.json").is_file()
    assert archive_from_path(copy).parent.name == first.parent.name  # keyed by content, not path


@pytest.mark.parametrize(
    "case, source",
    [("base", "its config.json and safetensors headers"), ("llama_gguf", "its GGUF tensor table")],
)
def test_a_model_larger_than_the_memory_budget_is_refused_507_before_it_is_converted(
    inprocess_factory, paths, tmp_path_factory, case, source
):
    """The estimate (weights in the serving dtype, the KV pool, the overhead) is read from the
    folder's headers or the GGUF's tensor table: nothing is converted or copied into the cache."""
    cache = tmp_path_factory.mktemp("cache507")
    mp = pytest.MonkeyPatch()
    mp.setenv("PAGEDSERVE_CACHE_DIR", str(cache))
    root = re.escape(str(paths["base"].parent.resolve()))
    small = inprocess_factory(enable_model_api=True, allowed_urls=[f"{root}/.*"], memory_budget="64MiB")
    try:
        r = _register(small, paths[case])
        assert r.status == 507, r.text
        message = r.json()["message"]
        assert re.search(
            rf"model {paths[case].name} needs about [0-9.]+ GiB per worker \(weights [0-9.]+ (KiB|MiB) \+ KV pool "
            rf"1.00 GiB \+ overhead [0-9.]+ MiB, estimated from {source} before converting it\), more than the "
            r"whole memory budget of 64.0 MiB",
            message,
        ), message
        assert small.get("management", "/models").json() == {"models": []}
        assert not (cache / "from-path").exists()  # no archive built, no file even hashed
    finally:
        mp.undo()


def test_a_chat_template_given_at_registration_survives_a_restart(inprocess_factory, paths, tmp_path_factory):
    """The snapshot keeps the template (a restored model chats); a model registered without
    one has none in its entry."""
    mp = pytest.MonkeyPatch()
    mp.setenv("PAGEDSERVE_CACHE_DIR", str(tmp_path_factory.mktemp("cache-restart")))
    snapshot = tmp_path_factory.mktemp("snap") / "snapshot.json"
    root = re.escape(str(paths["base"].parent.resolve()))
    settings = {"enable_model_api": True, "allowed_urls": [f"{root}/.*"], "snapshot_path": str(snapshot)}
    try:
        first = inprocess_factory(**settings)
        r = _register(first, paths["base"], model_name="chatty", chat_template=TEMPLATE, initial_workers=0)
        assert r.status == 200, r.text
        assert _register(first, paths["base"], model_name="plain", initial_workers=0).status == 200
        entries = {e["name"]: e for e in json.loads(snapshot.read_text())["models"]}
        assert entries["chatty"]["chat_template"] == TEMPLATE and "chat_template" not in entries["plain"]
        first.stop()
        again = inprocess_factory(**settings)
        chat = again.post(
            "inference",
            "/v1/chat/completions",
            json={"model": "chatty", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 3},
        )
        assert chat.status == 200, chat.text
        plain = again.post(
            "inference",
            "/v1/chat/completions",
            json={"model": "plain", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 3},
        )
        assert plain.status == 400 and "has no chat template" in plain.json()["error"]["message"], plain.text
    finally:
        mp.undo()
