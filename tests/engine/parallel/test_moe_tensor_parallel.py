"""Mixture of experts under tensor parallelism (gloo, CPU): every rank holds every expert with a
slice of its intermediate size, the router whole. TP = 2 generates what TP = 1 does on tiny
random Qwen2-MoE (gated shared expert, a dense layer) and Mixtral (w1/w2/w3 names) configs;
each rank reads its experts' slices; sizes that do not divide are refused, and so is OLMoE with
KV heads replicated (its TP run is in tests/engine/parallel/test_families_tensor_parallel.py)."""

from __future__ import annotations

import shutil

import pytest
import torch
import transformers

from pagedserve.engine import LLM, SamplingParams
from pagedserve.engine.model.layers.moe import MoESpec, RouterScoring
from pagedserve.engine.model.registry import check_tensor_parallel_support, parse_config
from pagedserve.engine.model.sharding import TensorSlice, check_tensor_parallel, shard_spec, tensor_slice
from pagedserve.engine.model.spec import ModelSpec
from tests.engine.parallel.test_tensor_parallel import PROMPTS, assert_same_generation

COMMON = {
    "vocab_size": 49152,
    "hidden_size": 64,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "max_position_embeddings": 256,
    "tie_word_embeddings": False,
}
CONFIGS = {
    "qwen2_moe": lambda: transformers.Qwen2MoeConfig(
        **COMMON,
        num_hidden_layers=3,
        intermediate_size=96,
        num_experts=8,
        num_experts_per_tok=2,
        moe_intermediate_size=32,
        shared_expert_intermediate_size=48,
        mlp_only_layers=[1],
    ),
    "mixtral": lambda: transformers.MixtralConfig(
        **COMMON, num_hidden_layers=2, intermediate_size=48, num_local_experts=4, num_experts_per_tok=2
    ),
}


@pytest.fixture(scope="module", autouse=True)
def keep_torch_threads():
    threads = torch.get_num_threads()
    yield
    torch.set_num_threads(threads)


@pytest.fixture(scope="module", params=list(CONFIGS))
def moe_model(request, tmp_path_factory, default_model_dir):
    path = tmp_path_factory.mktemp(request.param) / "model"
    torch.manual_seed(0)
    transformers.AutoModelForCausalLM.from_config(CONFIGS[request.param]()).save_pretrained(
        path, safe_serialization=True
    )
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(default_model_dir / name, path / name)
    return path


def test_tp2_generates_what_tp1_does(moe_model):
    options = {"dtype": "float32", "num_kv_blocks": 64, "max_model_len": 256}
    params = SamplingParams(max_tokens=12, temperature=0, logprobs=3, ignore_eos=True)
    ref = LLM(moe_model, num_threads=1, **options)
    expected = ref.generate(PROMPTS, params)
    del ref
    tp = LLM(moe_model, num_threads=2, tensor_parallel_size=2, **options)
    try:
        spec = tp.engine.runner.model.rank_spec
        assert spec.moe.intermediate_size * 2 == tp.engine.runner.model.spec.moe.intermediate_size
        assert_same_generation(expected, tp.generate(PROMPTS, params))
    finally:
        tp.shutdown()


def moe_spec(**moe) -> ModelSpec:
    block = {
        "num_experts": 4,
        "top_k": 2,
        "intermediate_size": 24,
        "scoring": RouterScoring.SOFTMAX_TOPK,
        "normalize": True,
        "shared_intermediate_size": 16,
        "shared_gate": True,
    }
    return ModelSpec(
        architecture="Qwen2MoeForCausalLM",
        vocab_size=48,
        hidden_size=32,
        intermediate_size=40,
        num_layers=2,
        num_heads=4,
        num_kv_heads=2,
        head_dim=8,
        rms_norm_eps=1e-6,
        max_position_embeddings=64,
        rope_theta=10000.0,
        rope_scaling=None,
        tie_word_embeddings=False,
        qkv_bias=True,
        o_bias=False,
        mlp_bias=False,
        sliding_window=None,
        moe=MoESpec(**{**block, **moe}),
    )


def test_expert_slices_follow_each_experts_intermediate_size():
    s = moe_spec()
    assert tensor_slice("model.layers.0.mlp.experts.3.gate_proj.weight", s, 1, 2) == TensorSlice(0, 12, 12, 24)
    assert tensor_slice("model.layers.0.mlp.experts.0.up_proj.weight", s, 0, 2) == TensorSlice(0, 0, 12, 24)
    assert tensor_slice("model.layers.1.mlp.experts.2.down_proj.weight", s, 1, 2) == TensorSlice(1, 12, 12, 24)
    assert tensor_slice("model.layers.0.mlp.shared_expert.up_proj.weight", s, 1, 2) == TensorSlice(0, 8, 8, 16)
    assert tensor_slice("model.layers.0.mlp.shared_expert.down_proj.weight", s, 1, 2) == TensorSlice(1, 8, 8, 16)
    assert tensor_slice("model.layers.0.block_sparse_moe.experts.1.w1.weight", s, 1, 2) == TensorSlice(0, 12, 12, 24)
    assert tensor_slice("model.layers.0.block_sparse_moe.experts.1.w2.weight", s, 1, 2) == TensorSlice(1, 12, 12, 24)
    # The router and the shared expert's gate are whole on every rank; a dense layer's MLP as before.
    for name in (
        "model.layers.0.mlp.gate.weight",
        "model.layers.0.mlp.shared_expert_gate.weight",
        "model.layers.0.block_sparse_moe.gate.weight",
    ):
        assert tensor_slice(name, s, 1, 2) is None
    assert tensor_slice("model.layers.1.mlp.gate_proj.weight", s, 1, 2) == TensorSlice(0, 20, 20, 40)
    local = shard_spec(s, 2).moe
    assert (local.intermediate_size, local.shared_intermediate_size, local.num_experts) == (12, 8, 4)


@pytest.mark.parametrize(
    ("moe", "named"),
    [
        ({"intermediate_size": 30}, "expert intermediate size 30"),
        ({"shared_intermediate_size": 18}, "shared expert intermediate size 18"),
    ],
)
def test_expert_sizes_that_do_not_divide_are_named(moe, named):
    with pytest.raises(ValueError, match=f"tensor_parallel_size=4 does not divide the model's {named}"):
        check_tensor_parallel(moe_spec(**moe), 4)


def test_olmoe_with_fewer_kv_heads_than_ranks_is_refused():
    """Its k norm spans all KV heads: replicated KV heads would count twice in the split norm."""
    spec = parse_config(
        transformers.OlmoeConfig(
            **COMMON, num_hidden_layers=1, num_experts=4, num_experts_per_tok=2, intermediate_size=32
        )
    )
    check_tensor_parallel_support(spec, 4)
    check_tensor_parallel(spec, 2)
    with pytest.raises(
        ValueError,
        match=r"tensor_parallel_size=4 does not divide the model's 2 KV heads \(the k norm of OlmoeForCausalLM "
        r"spans all KV heads: each rank needs a share of them, none replicated\)",
    ):
        check_tensor_parallel(spec, 4)
