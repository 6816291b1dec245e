"""EngineConfig and SamplingParams validate at construction with messages naming the field."""

from __future__ import annotations

import pytest
import torch

from pagedserve.engine.config.engine import EngineConfig, EngineFields, PrefixCacheHash, SchedulingPolicy, parse_size
from pagedserve.engine.config.schema import SchemaError
from pagedserve.engine.sampling.params import SamplingParams, SamplingType


@pytest.mark.parametrize(
    "text, expected", [("2GiB", 2 * 2**30), ("512MB", 512 * 10**6), ("1.5 GiB", int(1.5 * 2**30)), (4096, 4096)]
)
def test_parse_size(text, expected):
    assert parse_size(text) == expected


@pytest.mark.parametrize("bad", ["", "lots", "-1GiB", 0, -5, True])
def test_parse_size_refuses(bad):
    with pytest.raises(ValueError):
        parse_size(bad)


def test_defaults_and_coercion():
    c = EngineConfig(model="m", dtype="bf16", prefix_cache_hash="builtin", scheduling_policy="priority")
    assert c.torch_dtype is torch.bfloat16 and c.dtype == "bfloat16"
    assert c.prefix_cache_hash is PrefixCacheHash.BUILTIN and c.scheduling_policy is SchedulingPolicy.PRIORITY
    assert c.enable_prefix_caching and c.block_size == 16 and c.kv_cache_memory == 2**30
    assert c.resolve_num_blocks(2**20) == 1024
    assert EngineConfig(model="m", num_kv_blocks=7).resolve_num_blocks(2**20) == 7


@pytest.mark.parametrize(
    "kwargs, message",
    [
        ({"dtype": "int8"}, "dtype"),
        ({"block_size": 12}, "power of two"),
        ({"block_size": 0}, "block_size"),
        ({"max_num_seqs": 0}, "max_num_seqs"),
        ({"max_num_batched_tokens": -1}, "max_num_batched_tokens"),
        ({"num_kv_blocks": 1}, "num_kv_blocks"),
        ({"kv_cache_memory": "many"}, "kv_cache_memory: must be a size such as 2GiB"),
        ({"scheduling_policy": "lifo"}, "scheduling_policy"),
        ({"prefix_cache_hash": "md5"}, "prefix_cache_hash"),
        ({"device": "tpu"}, "device"),
        ({"max_model_len": 0}, "max_model_len"),
    ],
)
def test_engine_config_refuses(kwargs, message):
    with pytest.raises(ValueError, match=message):
        EngineConfig(model="m", **kwargs)


@pytest.mark.parametrize(
    "kwargs, field, message",
    [
        ({"max_num_seqs": 0}, "max_num_seqs", "max_num_seqs: must be >= 1, got 0"),
        ({"quant_group_size": 48}, "quant_group_size", "quant_group_size: must be one of 32, 64, 128, got 48"),
        (
            {"kv_offload": {"chunk_size": "big"}},
            "kv_offload.chunk_size",
            'kv_offload.chunk_size: must be an integer, got "big"',
        ),
        ({"tensor_parallel_size": 65}, "tensor_parallel_size", "tensor_parallel_size: must be <= 64, got 65"),
    ],
)
def test_the_schema_refuses_a_bad_engine_config_naming_the_field(kwargs, field, message):
    """The bounds are declared on EngineFields (msgspec Meta); the refusal comes from the schema,
    the same one model-config.yaml's handler section and the docs' reference are derived from."""
    with pytest.raises(SchemaError) as refused:
        EngineConfig(model="m", **kwargs)
    assert refused.value.field == field and str(refused.value) == message
    declared = {f.name: f for f in __import__("msgspec").structs.fields(EngineFields)}
    assert field.split(".")[0] in declared


def test_max_model_len_cannot_exceed_the_model():
    with pytest.raises(ValueError, match="max_position_embeddings"):
        EngineConfig(model="m", max_model_len=9000).resolve_max_model_len(8192)


@pytest.mark.parametrize(
    "kwargs, message",
    [
        ({"temperature": -1}, "temperature"),
        ({"top_p": 0}, "top_p"),
        ({"top_p": 1.01}, "top_p"),
        ({"top_k": -2}, "top_k"),
        ({"min_p": 2}, "min_p"),
        ({"max_tokens": 0}, "max_tokens"),
        ({"min_tokens": 5, "max_tokens": 2}, "min_tokens"),
        ({"n": 0}, "n: must"),
        ({"logprobs": 21}, "logprobs"),
        ({"presence_penalty": 3}, "presence_penalty"),
        ({"repetition_penalty": 0}, "repetition_penalty"),
        ({"stop": [""]}, "stop"),
        ({"temperature": float("nan")}, "NaN"),
        ({"seed": 1.5}, "seed"),
    ],
)
def test_sampling_params_refuse(kwargs, message):
    with pytest.raises(ValueError, match=message):
        SamplingParams(**kwargs)


def test_sampling_params_normalise():
    p = SamplingParams(stop="END", top_k=-1, temperature=0)
    assert p.stop == ["END"] and p.top_k == 0 and p.sampling_type is SamplingType.GREEDY
    assert not p.has_penalties and SamplingParams(repetition_penalty=1.2).has_penalties
