"""`pagedserve archive` end to end, run as `python -m pagedserve.server.cli archive ...` in a subprocess."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[3]
SUFFIX = {"default": ".mar", "tgz": ".tar.gz", "no-archive": ""}


def cli(*args: str, cwd: Path) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    return subprocess.run(
        [sys.executable, "-m", "pagedserve.server.cli", "archive", *args],
        cwd=cwd,
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )


@pytest.fixture(scope="module")
def tiny_model(tmp_path_factory) -> Path:
    """A tiny random Llama saved by transformers, with the default model's tokenizer files."""
    transformers = pytest.importorskip("transformers")
    from pagedserve.engine.model.default_model import default_gguf_path, default_model_dir

    try:
        default_gguf_path()
    except FileNotFoundError as exc:
        pytest.skip(str(exc))
    d = tmp_path_factory.mktemp("tiny")
    config = transformers.LlamaConfig(
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=2,
        num_key_value_heads=2,
        vocab_size=64,
    )
    transformers.LlamaForCausalLM(config).save_pretrained(d, safe_serialization=True)
    source = default_model_dir()
    for name in ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja"):
        shutil.copy(source / name, d / name)
    return d


@pytest.fixture
def config_yaml(tmp_path: Path) -> Path:
    p = tmp_path / "model-config.yaml"
    p.write_text("maxWorkers: 2\nhandler:\n  max_num_seqs: 4\n  kv_cache_memory: 64MiB\n")
    return p


def build(tiny_model: Path, tmp_path: Path, fmt: str, *extra: str) -> subprocess.CompletedProcess:
    return cli(
        "--model-name",
        "tiny",
        "--version",
        "1.0",
        "--model-dir",
        str(tiny_model),
        "--archive-format",
        fmt,
        *extra,
        cwd=tmp_path,
    )


@pytest.mark.parametrize("fmt", ["default", "tgz", "no-archive"])
def test_archive_and_inspect_each_format(tmp_path, tiny_model, config_yaml, fmt):
    notes = tmp_path / "NOTES.txt"
    notes.write_text("extra\n")
    result = build(tiny_model, tmp_path, fmt, "--config-file", str(config_yaml), "--extra-files", str(notes))
    assert result.returncode == 0, result.stderr
    dest = tmp_path / "model_store" / f"tiny{SUFFIX[fmt]}"  # default --export-path
    assert result.stdout.strip() == str(dest) and dest.exists()
    assert [p.name for p in dest.parent.iterdir()] == [dest.name]  # no temporary leftovers

    result = cli("--inspect", str(dest), cwd=tmp_path)
    assert result.returncode == 0, result.stderr
    report = json.loads(result.stdout)
    model = report["manifest"]["model"]
    assert (model["modelName"], model["modelVersion"], model["handler"]) == ("tiny", "1.0", "llm")
    assert model["configFile"] == "model-config.yaml"
    assert {"config.json", "model.safetensors", "tokenizer.json", "NOTES.txt", "model-config.yaml"} <= set(
        report["manifest"]["files"]
    )
    config = report["model_config"]
    assert config["maxWorkers"] == 2 and config["minWorkers"] == 1
    assert config["handler"]["max_num_seqs"] == 4
    assert config["handler"]["kv_cache_memory"] == 64 << 20
    assert config["handler"]["block_size"] == 16  # default filled in
    assert report["custom_handler"] is None


def test_refuses_overwrite_without_force(tmp_path, tiny_model):
    export = tmp_path / "out"
    assert build(tiny_model, tmp_path, "default", "--export-path", str(export)).returncode == 0
    first = (export / "tiny.mar").read_bytes()
    result = build(tiny_model, tmp_path, "default", "--export-path", str(export))
    assert result.returncode != 0
    assert result.stderr.startswith("pagedserve: error: ") and "already exists" in result.stderr
    assert (export / "tiny.mar").read_bytes() == first
    result = build(tiny_model, tmp_path, "default", "--export-path", str(export), "--force")
    assert result.returncode == 0, result.stderr
    assert sorted(p.name for p in export.iterdir()) == ["tiny.mar"]


def test_inspect_refuses_tampered_archive(tmp_path, tiny_model):
    assert build(tiny_model, tmp_path, "default").returncode == 0
    good = tmp_path / "model_store" / "tiny.mar"
    bad = tmp_path / "tampered.mar"
    with zipfile.ZipFile(good) as src, zipfile.ZipFile(bad, "w") as dst:
        for info in src.infolist():
            data = src.read(info)
            if info.filename == "tokenizer_config.json":
                data = data.replace(b"{", b"{ ", 1)
            dst.writestr(info, data)
    result = cli("--inspect", str(bad), cwd=tmp_path)
    assert result.returncode != 0 and result.stdout == ""
    assert result.stderr.startswith("pagedserve: error: ")
    assert "sha256 mismatch for tokenizer_config.json" in result.stderr
    assert "Traceback" not in result.stderr


def test_invalid_config_file_is_refused(tmp_path, tiny_model):
    bad = tmp_path / "model-config.yaml"
    bad.write_text("handler:\n  max_num_seqs: 0\n")
    result = build(tiny_model, tmp_path, "default", "--config-file", str(bad))
    assert result.returncode != 0
    assert ("pagedserve: error: model-config.yaml: handler.max_num_seqs: must be >= 1, got 0") in result.stderr
    assert not (tmp_path / "model_store").exists()


def test_missing_arguments(tmp_path):
    result = cli("--model-name", "tiny", cwd=tmp_path)
    assert result.returncode != 0
    assert "--version" in result.stderr and "--model-dir" in result.stderr


@pytest.mark.slow
def test_default_model_archive_inspects(tmp_path, default_model_dir):
    made = cli(
        "--model-name",
        "smollm2",
        "--version",
        "1.0",
        "--default-model",
        "--archive-format",
        "no-archive",
        "--export-path",
        str(tmp_path / "store"),
        cwd=tmp_path,
    )
    assert made.returncode == 0, made.stderr
    inspected = cli("--inspect", str(tmp_path / "store" / "smollm2"), cwd=tmp_path)
    assert inspected.returncode == 0, inspected.stderr
    report = json.loads(inspected.stdout)
    assert report["manifest"]["model"]["modelName"] == "smollm2"
    assert report["manifest"]["model"]["serializedFile"] == "model.safetensors"
