"""model-configs written for TorchServe's vllm_handler, read as pagedserve's (no model needed)."""

from __future__ import annotations

import logging

import pytest

from pagedserve.engine.model import vllm_config
from pagedserve.engine.model.model_config import ModelConfig, ModelConfigError

VLLM = {
    "minWorkers": 1,
    "maxWorkers": 2,
    "batchSize": 1,
    "maxBatchDelay": 100,
    "asyncCommunication": True,
    "startupTimeout": 1200,
    "handler": {
        "model_path": "model/models--org--m/snapshots/abc",
        "vllm_engine_config": {
            "max_num_seqs": 16,
            "max_model_len": 250,
            "dtype": "half",
            "block_size": 32,
            "enable_prefix_caching": False,
            "num_gpu_blocks_override": 64,
            "seed": 3,
            "tensor_parallel_size": 1,
            "served_model_name": ["org/m"],
            "gpu_memory_utilization": 0.9,
            "swap_space": 4,
        },
        "adapters": {"a1": "adapters/a1"},
    },
}


def test_engine_keys_are_mapped_and_the_rest_named_in_warnings(caplog):
    with caplog.at_level(logging.WARNING):
        config = ModelConfig.from_dict(VLLM)
    assert config.engine_options() == {
        "max_num_seqs": 16,
        "max_model_len": 250,
        "dtype": "float16",
        "block_size": 32,
        "enable_prefix_caching": False,
        "num_kv_blocks": 64,
        "seed": 3,
    }
    assert (config.min_workers, config.max_workers, config.startup_timeout) == (1, 2, 1200)
    warned = [r.getMessage() for r in caplog.records]
    for name in (
        "maxBatchDelay",
        "asyncCommunication",
        "vllm_engine_config.gpu_memory_utilization",
        "vllm_engine_config.swap_space",
        "handler.adapters",
    ):
        assert sum(name in w for w in warned) == 1, (name, warned)
    for quiet in ("batchSize", "tensor_parallel_size", "served_model_name", "model_path", "max_num_seqs"):
        assert not any(quiet in w for w in warned), quiet


def test_plain_configs_pass_unchanged_and_bad_values_are_named():
    plain = {"minWorkers": 1, "handler": {"max_num_seqs": 4}}
    assert vllm_config.translate(plain) == (plain, [])
    with pytest.raises(ModelConfigError, match="vllm_engine_config: must be a mapping"):
        ModelConfig.from_dict({"handler": {"vllm_engine_config": ["max_num_seqs"]}})
    with pytest.raises(ModelConfigError, match="handler.max_num_seqs"):
        ModelConfig.from_dict({"handler": {"vllm_engine_config": {"max_num_seqs": 0}}})
    with pytest.raises(ModelConfigError, match="maxBatchDelay"):  # only vLLM-style files drop it
        ModelConfig.from_dict({"maxBatchDelay": 100})
