"""A quantized archive served end to end: the tiny model quantized to int8 at archive time, with
an fp8 KV cache from its model-config, behind the real server (in-process, real workers) on
/predictions and the OpenAI routes."""

from __future__ import annotations

import pytest
import torch

from pagedserve.engine.attention.kv_dtype import KVCacheDtype
from pagedserve.engine.model.archive import write_archive
from pagedserve.engine.model.kv_pool_size import kv_cache_bytes_per_block
from pagedserve.engine.model.loader import read_config
from pagedserve.engine.model.quant_convert import quantize_model_dir
from tests.server.conftest import TINY_MODEL_CONFIG

NAME = "tinyq"


@pytest.fixture(scope="module")
def quantized_server(inprocess_factory, tiny_model, tmp_path_factory):
    store = tmp_path_factory.mktemp("quant_store")
    build = tmp_path_factory.mktemp("quant_build")
    model = quantize_model_dir(tiny_model, build / "model", "int8")
    config = build / "model-config.yaml"
    config.write_text(TINY_MODEL_CONFIG + "  kv_cache_dtype: fp8_e4m3\n")
    write_archive(model, store, model_name=NAME, version="1.0", config_file=config)
    return inprocess_factory(model_store=str(store), load_models=[f"{NAME}={NAME}.mar"])


def test_predictions_and_openai_routes_serve_the_quantized_archive(quantized_server, tiny_model):
    r = quantized_server.post(
        "inference",
        f"/predictions/{NAME}",
        json={"prompt": "1, 2, 3,", "max_tokens": 5, "temperature": 0, "ignore_eos": True},
    )
    assert r.status == 200, r.text()
    assert len(r.json()["choices"][0]["token_ids"]) == 5
    r = quantized_server.post(
        "inference",
        "/v1/completions",
        json={"model": NAME, "prompt": "1, 2, 3,", "max_tokens": 4, "temperature": 0, "ignore_eos": True},
    )
    assert r.status == 200, r.text()
    assert r.json()["usage"]["completion_tokens"] == 4
    r = quantized_server.post(
        "inference",
        "/v1/chat/completions",
        json={
            "model": NAME,
            "messages": [{"role": "user", "content": "Hi"}],
            "max_tokens": 3,
            "temperature": 0,
            "ignore_eos": True,
        },
    )
    assert r.status == 200, r.text()
    assert r.json()["usage"]["completion_tokens"] == 3
    # The worker's pool is sized for fp8 rows (16 codes + a 2-byte scale instead of 16 float32s).
    [version] = quantized_server.state.registry.all_versions()
    [engine] = version.pool.ready_engines()
    per_block = kv_cache_bytes_per_block(read_config(tiny_model), 16, torch.float32, KVCacheDtype.FP8_E4M3)
    assert engine.stats.num_kv_blocks == 8 * 2**20 // per_block
    # The same prompt again is served from the (fp8) prefix cache with the same tokens.
    body = {"prompt": list(range(100, 140)), "max_tokens": 4, "temperature": 0, "ignore_eos": True}
    first = quantized_server.post("inference", f"/predictions/{NAME}", json=body).json()
    again = quantized_server.post("inference", f"/predictions/{NAME}", json=body).json()
    assert again["usage"]["cached_prompt_tokens"] >= 32
    assert again["choices"][0]["token_ids"] == first["choices"][0]["token_ids"]
