"""model-config.yaml: parsing, defaults, and errors that name the key; open_archive refuses a bad one."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from pagedserve.engine.config.engine import EngineConfig
from pagedserve.engine.model.archive import ArchiveError, open_archive, write_archive
from pagedserve.engine.model.model_config import (
    FRONTEND_KEYS,
    HANDLER_KEYS,
    HANDLER_OPTIONS_KEY,
    DeviceType,
    ModelConfig,
    ModelConfigError,
    load_model_config,
)

EXAMPLE = Path(__file__).resolve().parents[3] / "config" / "model-config.yaml"

VALID = """\
minWorkers: 1
maxWorkers: 2
responseTimeout: 60
startupTimeout: 300
deviceType: gpu
parallelType: tp
parallelLevel: 1
jobQueueSize: 10
handler:
  dtype: bf16
  max_model_len: 512
  block_size: 32
  kv_cache_memory: 256MiB
  max_num_seqs: 8
  max_num_batched_tokens: 1024
  enable_prefix_caching: false
  prefix_cache_hash: builtin
  scheduling_policy: priority
  seed: 7
  num_threads: 2
"""


def write(tmp_path: Path, text: str) -> Path:
    p = tmp_path / "model-config.yaml"
    p.write_text(text)
    return p


def test_valid_file_round_trip(tmp_path):
    config = load_model_config(write(tmp_path, VALID))
    assert (config.min_workers, config.max_workers, config.response_timeout) == (1, 2, 60)
    assert config.device_type is DeviceType.GPU and config.job_queue_size == 10
    options = config.engine_options()
    assert options["max_num_seqs"] == 8 and options["kv_cache_memory"] == "256MiB"
    engine = EngineConfig(model="m", **options)
    assert engine.dtype == "bfloat16" and engine.kv_cache_memory == 256 << 20
    resolved = config.resolved()
    assert json.loads(json.dumps(resolved)) == resolved  # JSON-serialisable
    assert resolved["deviceType"] == "gpu" and resolved["parallelType"] == "tp"
    assert resolved["handler"]["prefix_cache_hash"] == "builtin"
    assert resolved["handler"]["scheduling_policy"] == "priority"
    # writing the resolved settings back gives the same configuration
    again = ModelConfig.from_dict(resolved)
    assert again.resolved() == resolved


def test_empty_file_is_all_defaults(tmp_path):
    config = load_model_config(write(tmp_path, ""))
    assert config == ModelConfig() and config.engine_options() == {}
    assert config.resolved()["handler"]["block_size"] == 16


def test_documented_example_covers_every_key_with_its_default():
    config = load_model_config(EXAMPLE)
    assert config.resolved() == ModelConfig().resolved()
    text = EXAMPLE.read_text()
    for key in (*FRONTEND_KEYS, *HANDLER_KEYS, HANDLER_OPTIONS_KEY):
        assert f"{key}:" in text, key


def test_handler_options_are_for_the_handler_not_the_engine(tmp_path):
    config = load_model_config(
        write(tmp_path, "handler:\n  max_num_seqs: 4\n  options:\n    greeting: hi\n    max_num_seqs: any\n")
    )
    assert config.handler_options == {"greeting": "hi", "max_num_seqs": "any"}
    assert config.engine_options() == {"max_num_seqs": 4}
    assert config.resolved()["handler"]["options"] == {"greeting": "hi", "max_num_seqs": "any"}
    with pytest.raises(ModelConfigError, match=r"handler.options: must be an object or null, got \[\"x\"\]"):
        load_model_config(write(tmp_path, "handler:\n  options: [x]\n"))


@pytest.mark.parametrize(
    "text, message",
    [
        ("handler:\n  max_num_seqs: 0\n", "model-config.yaml: handler.max_num_seqs: must be >= 1, got 0"),
        ("handler:\n  block_size: 24\n", "handler.block_size: must be a power of two, got 24"),
        (
            "handler:\n  dtype: int8\n",
            'handler.dtype: must be one of "bf16", "bfloat16", "float16", "float32", "fp16", "fp32", got "int8"',
        ),
        (
            "handler:\n  kv_cache_memory: lots\n",
            'handler.kv_cache_memory: must be a size such as 2GiB, 512MiB or a byte count, got "lots"',
        ),
        ("handler:\n  num_kv_blocks: 1\n", "handler.num_kv_blocks: must be >= 2, got 1"),
        (
            "handler:\n  prefix_cache_hash: md5\n",
            'handler.prefix_cache_hash: must be one of "sha256", "builtin", got "md5"',
        ),
        (
            "handler:\n  scheduling_policy: lifo\n",
            'handler.scheduling_policy: must be one of "fcfs", "priority", got "lifo"',
        ),
        ("handler:\n  seed: -1\n", "handler.seed: must be >= 0, got -1"),
        ("minWorkers: -1\n", "minWorkers: must be >= 0, got -1"),
        ("jobQueueSize: -5\n", "jobQueueSize: must be >= 1, got -5"),
        ("minWorkers: 3\nmaxWorkers: 2\n", "minWorkers: must not exceed maxWorkers (2), got 3"),
        ("deviceType: tpu\n", "deviceType: choose one of 'cpu', 'gpu', got 'tpu'"),
        ("parallelType: dp\n", "parallelType: choose one of"),
    ],
)
def test_bad_value_names_key_and_value(tmp_path, text, message):
    _assert_refused(tmp_path, text, message)


@pytest.mark.parametrize(
    "text, message",
    [
        ("handler:\n  max_num_seqs: '8'\n", "handler.max_num_seqs: must be an integer, got \"8\""),
        (
            "handler:\n  enable_prefix_caching: 'yes'\n",
            "handler.enable_prefix_caching: must be true or false, got \"yes\"",
        ),
        ("handler:\n  block_size: true\n", "handler.block_size: must be an integer, got true"),
        ("handler:\n  dtype: 16\n", "handler.dtype: must be a string, got 16"),
        ("handler:\n  kv_cache_memory: [1]\n", "handler.kv_cache_memory: must be an integer or a string, got [1]"),
        ("responseTimeout: 1.5\n", "responseTimeout: must be an integer, got 1.5"),
        ("handler: [dtype]\n", "handler: must be a mapping"),
        ("- minWorkers\n", "the top level must be a mapping"),
    ],
)
def test_wrong_type_names_key(tmp_path, text, message):
    _assert_refused(tmp_path, text, message)


def _assert_refused(tmp_path, text: str, message: str) -> None:
    with pytest.raises(ModelConfigError) as info:
        load_model_config(write(tmp_path, text))
    assert message in str(info.value)
    assert isinstance(info.value, ValueError)


def test_unknown_keys_name_the_key_and_list_allowed(tmp_path):
    with pytest.raises(ModelConfigError) as info:
        load_model_config(write(tmp_path, "batchSize: 4\n"))
    assert "unknown key 'batchSize'" in str(info.value) and "maxWorkers" in str(info.value)
    with pytest.raises(ModelConfigError) as info:
        load_model_config(write(tmp_path, "handler:\n  max_num_seq: 4\n"))
    assert "unknown key handler.max_num_seq" in str(info.value)
    assert "max_num_seqs" in str(info.value)
    for excluded in ("model", "device"):
        with pytest.raises(ModelConfigError, match=f"unknown key handler.{excluded}"):
            load_model_config(write(tmp_path, f"handler:\n  {excluded}: x\n"))


def test_invalid_yaml(tmp_path):
    with pytest.raises(ModelConfigError, match="not valid YAML"):
        load_model_config(write(tmp_path, "handler: [unclosed\n"))


def test_open_archive_refuses_invalid_model_config(tmp_path):
    model = tmp_path / "model"
    model.mkdir()
    (model / "config.json").write_text(
        json.dumps(
            {
                "architectures": ["LlamaForCausalLM"],
                "model_type": "llama",
                "hidden_size": 32,
                "intermediate_size": 64,
                "num_hidden_layers": 2,
                "num_attention_heads": 2,
                "num_key_value_heads": 2,
                "vocab_size": 64,
            }
        )
    )
    (model / "model.safetensors").write_bytes(b"\x08\x00\x00\x00\x00\x00\x00\x00{}      ")
    config = write(tmp_path, "handler:\n  max_num_seqs: 0\n")
    out = write_archive(model, tmp_path / "store", model_name="m", version="1", config_file=config)
    with pytest.raises(ArchiveError, match=r"handler\.max_num_seqs: must be >= 1, got 0"):
        open_archive(out, tmp_path / "opened")
    assert not (tmp_path / "opened").exists()
