"""Quantized models end to end: the bundled Q4_1 GGUF kept as int4 (lossless), quantization at
load and at archive time, the engine serving them, and the errors for contradicting options."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors import safe_open

from pagedserve.engine import LLM, SamplingParams
from pagedserve.engine.model.default_model import default_gguf_path, default_model_dir
from pagedserve.engine.model.quant_convert import convert_gguf_quantized, quantize_model_dir
from pagedserve.engine.model.quant_linear import Int4Linear, Int8Embedding, Int8Linear, unpack_nibbles
from pagedserve.kernels.cpu_isa import cpu_has_vnni

REPO = Path(__file__).resolve().parents[3]
PROMPT, ANSWER = "1, 2, 3, 4,", " 5, 6, 7"  # a robust greedy check (notes: margin 3.5 nats)


@pytest.fixture(scope="module")
def q41_dir(tmp_path_factory):
    return convert_gguf_quantized(default_gguf_path(), tmp_path_factory.mktemp("q41") / "model")


def _archive_cli(*args: str, cwd) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    return subprocess.run(
        [sys.executable, "-m", "pagedserve.server.cli", "archive", *args],
        cwd=cwd,
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
    )


def test_archive_gguf_keeps_its_quantization_through_inspect(tmp_path):
    """`pagedserve archive --gguf` of the bundled Q4_1 file stores int4 (no float weights) and
    `--inspect` reports it; the engine serves the archive."""
    made = _archive_cli(
        "--model-name",
        "smollm2q",
        "--version",
        "1.0",
        "--gguf",
        str(default_gguf_path()),
        "--export-path",
        str(tmp_path / "store"),
        cwd=tmp_path,
    )
    assert made.returncode == 0, made.stderr
    archive = tmp_path / "store" / "smollm2q.mar"
    assert archive.stat().st_size < 130 * 2**20  # the float32 conversion is ~540 MB
    inspected = _archive_cli("--inspect", str(archive), cwd=tmp_path)
    assert inspected.returncode == 0, inspected.stderr
    quant = json.loads(inspected.stdout)["manifest"]["model"]["quantization"]
    assert quant["method"] == "int4" and quant["group_size"] == 32 and "Q4_1" in quant["source"]
    llm = LLM(archive, dtype="bfloat16", num_kv_blocks=32, max_model_len=256)
    assert _greedy(llm).startswith(ANSWER)


def _greedy(llm: LLM) -> str:
    return llm.generate([PROMPT], SamplingParams(max_tokens=8, temperature=0))[0].outputs[0].text


def test_q41_as_int4_holds_exactly_the_dequantized_values(q41_dir):
    """Every projection's codes * scale + offset equals the float32 weights transformers
    de-quantized from the same file (the default model's converted directory), bit for bit."""
    config = json.loads((q41_dir / "config.json").read_text())
    assert config["pagedserve_quantization"]["method"] == "int4"
    assert "Q4_1" in config["pagedserve_quantization"]["source"]
    plain_dir = default_model_dir()
    checked = 0
    with (
        safe_open(str(q41_dir / "model.safetensors"), "pt") as q,
        safe_open(str(plain_dir / "model.safetensors"), "pt") as plain,
    ):
        for name in q.keys():
            if not name.endswith(".offsets"):
                continue
            base = name.removesuffix(".offsets")
            codes = unpack_nibbles(q.get_tensor(f"{base}.qweight"))
            scale, offset = q.get_tensor(f"{base}.scales"), q.get_tensor(name)
            values = codes.float().view(codes.shape[0], -1, 32) * scale[..., None] + offset[..., None]
            assert torch.equal(values.view(codes.shape), plain.get_tensor(f"{base}.weight")), base
            checked += 1
    assert checked == 30 * 7


def test_engine_serves_the_gguf_quantization(q41_dir):
    llm = LLM(q41_dir, dtype="bfloat16", num_kv_blocks=32, max_model_len=256)
    layers = llm.engine.runner.model.model.layers
    assert isinstance(layers[0].self_attn.qkv_proj, Int4Linear)
    assert isinstance(layers[0].mlp.down_proj, Int4Linear)
    assert isinstance(llm.engine.runner.model.model.embed_tokens, Int8Embedding)
    assert _greedy(llm).startswith(ANSWER)


def test_quantized_checkpoint_refuses_a_contradicting_option(q41_dir):
    with pytest.raises(ValueError, match=r"already quantized \(int4.*quantization='int8' contradicts"):
        LLM(q41_dir, dtype="bfloat16", num_kv_blocks=32, max_model_len=256, quantization="int8")
    with pytest.raises(ValueError, match="group size 64"):
        LLM(q41_dir, dtype="bfloat16", num_kv_blocks=32, max_model_len=256, quantization="int4", quant_group_size=64)


@pytest.mark.parametrize("method", ["int8", "int4", "w8a8"])
def test_quantized_at_load(method):
    if method == "w8a8" and not cpu_has_vnni():  # AMD Zen 3, say: refused, naming what to use
        with pytest.raises(ValueError, match=r"w8a8' needs a CPU with VNNI.*use 'int8' or 'int4'"):
            LLM(default_model_dir(), dtype="bfloat16", num_kv_blocks=32, max_model_len=256, quantization=method)
        return
    llm = LLM(default_model_dir(), dtype="bfloat16", num_kv_blocks=32, max_model_len=256, quantization=method)
    qkv = llm.engine.runner.model.model.layers[0].self_attn.qkv_proj
    assert isinstance(qkv, Int4Linear if method == "int4" else Int8Linear)
    assert _greedy(llm).startswith(ANSWER)


def test_quantized_at_archive_time_loads_the_same_layers(tmp_path):
    out = quantize_model_dir(default_model_dir(), tmp_path / "int8", "int8")
    config = json.loads((out / "config.json").read_text())
    assert config["pagedserve_quantization"]["method"] == "int8"
    llm = LLM(out, dtype="bfloat16", num_kv_blocks=32, max_model_len=256)
    assert isinstance(llm.engine.runner.model.model.layers[3].mlp.gate_up_proj, Int8Linear)
    assert _greedy(llm).startswith(ANSWER)
    with pytest.raises(ValueError, match="already quantized"):
        quantize_model_dir(out, tmp_path / "again", "int4")


def test_bad_options_are_refused():
    with pytest.raises(ValueError, match="quantization: must be one of"):
        LLM(default_model_dir(), quantization="int3")
    with pytest.raises(ValueError, match="quant_group_size: must be one of 32, 64, 128, got 48"):
        LLM(default_model_dir(), quantization="int4", quant_group_size=48)


def test_w8a8_without_vnni_is_refused_naming_what_to_use(monkeypatch):
    """On a CPU that reports no VNNI / AMX (simulated: this one has it), w8a8 says to use int8 or int4."""
    import pagedserve.engine.model.quant_spec as quant_spec

    monkeypatch.setattr(quant_spec, "cpu_has_vnni", lambda: False)
    with pytest.raises(ValueError, match=r"w8a8' needs a CPU with VNNI.*use 'int8' or 'int4'"):
        quant_spec.resolve_spec({}, "w8a8", 32, "cpu")
    assert quant_spec.resolve_spec({}, "int8", 32, "cpu").method.value == "int8"


def test_a_group_size_that_does_not_divide_a_layer_is_refused():
    with pytest.raises(
        ValueError,
        match=r"group size 128 does not divide the layer's 576 input features; "
        r"choose one of \[32, 64\]",
    ):
        LLM(
            default_model_dir(),
            dtype="bfloat16",
            num_kv_blocks=8,
            max_model_len=64,
            quantization="int4",
            quant_group_size=128,
        )
