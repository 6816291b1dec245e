"""Quantized experts: every quantization mode (int8, int4, w8a8) applies to each expert's
projections and the shared expert's, as to any projection; the router and the shared expert's
gate stay in the model dtype. A block of int8 / int4 experts equals the float64 reference over
the de-quantized weights; whole tiny MoE models quantized at load (and a quantized archive) stay
close to their float logits through the engine."""

from __future__ import annotations

import pytest
import torch
import transformers
from torch import nn

from pagedserve.engine.config.engine import EngineConfig
from pagedserve.engine.core.engine_core import EngineCore
from pagedserve.engine.model.layers.moe import MoESpec, RouterScoring, SparseMoeBlock, route
from pagedserve.engine.model.quant_convert import quantize_model_dir
from pagedserve.engine.model.quant_linear import Int4Linear, Int8Linear, QuantMethod, make_quant_linear
from pagedserve.engine.request.request import Request
from pagedserve.engine.sampling.params import SamplingParams
from pagedserve.kernels.cpu_isa import cpu_has_vnni
from tests.engine.model.test_moe_layer import make_block

COMMON = {
    "vocab_size": 256,
    "hidden_size": 64,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "max_position_embeddings": 256,
    "initializer_range": 0.05,
    "tie_word_embeddings": False,
    "bos_token_id": None,
    "eos_token_id": None,
    "pad_token_id": None,
}
CONFIGS = {  # sizes int4 takes: outputs multiples of 64, inputs of 32
    "qwen2_moe": lambda: transformers.Qwen2MoeConfig(
        **COMMON,
        num_hidden_layers=2,
        intermediate_size=96,
        num_experts=8,
        num_experts_per_tok=2,
        moe_intermediate_size=32,
        shared_expert_intermediate_size=64,
        mlp_only_layers=[1],
    ),
    "mixtral": lambda: transformers.MixtralConfig(
        **COMMON, num_hidden_layers=2, intermediate_size=64, num_local_experts=4, num_experts_per_tok=2
    ),
}
METHODS = ["int8", "int4", "w8a8"]
QUANTIZED = {"int8": Int8Linear, "int4": Int4Linear, "w8a8": Int8Linear}


HIDDEN = 64  # int4 takes outputs in multiples of 64, inputs of 32
BLOCK = MoESpec(8, 2, 32, RouterScoring.SOFTMAX_TOPK, normalize=False, shared_intermediate_size=64, shared_gate=True)


def quantized_block(method: QuantMethod) -> SparseMoeBlock:
    block = make_block(BLOCK, torch.float32, hidden=HIDDEN)
    for expert in [*block.experts, block.shared_expert]:
        for name in ("gate_up_proj", "down_proj"):
            linear = getattr(expert, name)
            layer = make_quant_linear(method, linear.in_features, linear.out_features, False, torch.float32, 32)
            layer.quantize_rows(0, linear.weight)
            setattr(expert, name, layer)
    return block


@pytest.mark.parametrize("method", [QuantMethod.INT8, QuantMethod.INT4])
def test_quantized_experts_equal_the_reference_over_their_dequantized_weights(method):
    """Few rows per expert: the weight-only kernels, whose product is the de-quantized weight's."""
    block = quantized_block(method)
    h = torch.randn(12, HIDDEN, generator=torch.Generator().manual_seed(7))
    weights, ids = route(block.gate(h), 2, block.spec.scoring, block.spec.normalize)

    def mlp(expert, x):
        gate, up = (x @ expert.gate_up_proj.reference_weight().double().T).chunk(2, dim=-1)
        return (torch.nn.functional.silu(gate) * up) @ expert.down_proj.reference_weight().double().T

    x = h.double()
    ref = torch.zeros_like(x)
    for j in range(2):
        for t in range(len(x)):
            ref[t] += weights[t, j].double() * mlp(block.experts[int(ids[t, j])], x[t : t + 1])[0]
    ref += torch.sigmoid(x @ block.shared_expert_gate.weight.double().T) * mlp(block.shared_expert, x)
    torch.testing.assert_close(block(h).double(), ref, rtol=1e-4, atol=1e-4)


@pytest.fixture(scope="module", params=list(CONFIGS))
def moe_dir(request, tmp_path_factory):
    """A tiny random model with a decisive router (its weights x10): quantization noise must not
    flip near-tied expert choices, which would change outputs by far more than the noise."""
    path = tmp_path_factory.mktemp(request.param) / "model"
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(CONFIGS[request.param]())
    with torch.no_grad():
        for name, param in model.named_parameters():
            if name.endswith(".gate.weight"):
                param.mul_(10)
    model.save_pretrained(path, safe_serialization=True)
    return path


PROMPT = [5, 17, 99, 3, 250, 64, 128, 7, 31, 200, 11, 42]


def prompt_logits(path, **options) -> tuple[EngineCore, torch.Tensor]:
    """The engine and the logits of its first sampled token for PROMPT (captured where the
    sampler receives them)."""
    engine = EngineCore(EngineConfig(model=str(path), dtype="float32", num_kv_blocks=16, max_model_len=64, **options))
    model, captured = engine.runner.model, []
    compute = model.compute_logits
    model.compute_logits = lambda hidden: captured.append(compute(hidden)) or captured[-1]
    engine.add_request(Request("r", PROMPT, SamplingParams(max_tokens=1, temperature=0, ignore_eos=True)))
    while engine.has_unfinished_requests():
        engine.step()
    return engine, captured[0][0].float()


@pytest.fixture(scope="module")
def float_logits(moe_dir):
    return prompt_logits(moe_dir)[1]


@pytest.mark.parametrize("method", METHODS)
def test_quantized_at_load_reaches_every_expert(moe_dir, float_logits, method):
    if method == "w8a8" and not cpu_has_vnni():
        pytest.skip("w8a8 needs VNNI (refused otherwise: tests/engine/model/test_quant_model.py)")
    engine, logits = prompt_logits(moe_dir, quantization=method)
    sparse = [layer.mlp for layer in engine.runner.model.model.layers if isinstance(layer.mlp, SparseMoeBlock)]
    assert sparse
    for block in sparse:
        experts = [*block.experts] + ([block.shared_expert] if block.shared_expert is not None else [])
        for expert in experts:
            assert isinstance(expert.gate_up_proj, QUANTIZED[method])
            assert isinstance(expert.down_proj, QUANTIZED[method])
        assert type(block.gate) is nn.Linear and block.gate.weight.dtype == torch.float32  # the router
        if block.shared_expert_gate is not None:
            assert type(block.shared_expert_gate) is nn.Linear
    # Loose bounds (4-bit codes of Gaussian random weights lose most; a misplaced row or expert
    # gives an uncorrelated result, error ~1.4): the exact check is the block test above.
    error = (logits - float_logits).norm() / float_logits.norm()
    assert error < (0.3 if method == "int4" else 0.05), error


def test_a_quantized_archive_of_a_moe_model_loads_its_experts_quantized(moe_dir, float_logits, tmp_path):
    out = quantize_model_dir(moe_dir, tmp_path / "int8", "int8")
    engine, logits = prompt_logits(out)
    block = next(layer.mlp for layer in engine.runner.model.model.layers if isinstance(layer.mlp, SparseMoeBlock))
    assert isinstance(block.experts[0].gate_up_proj, Int8Linear)
    assert (logits - float_logits).norm() / float_logits.norm() < 0.03


def test_int4_refuses_experts_it_cannot_pack_naming_what_to_use(tmp_path):
    config = transformers.Qwen2MoeConfig(
        **{**COMMON, "vocab_size": 64},
        num_hidden_layers=1,
        intermediate_size=96,
        num_experts=4,
        num_experts_per_tok=2,
        moe_intermediate_size=48,
        shared_expert_intermediate_size=64,
    )
    transformers.AutoModelForCausalLM.from_config(config).save_pretrained(tmp_path, safe_serialization=True)
    with pytest.raises(ValueError, match="int4 needs output features divisible by 64, got 96; use int8"):
        EngineCore(
            EngineConfig(model=str(tmp_path), dtype="float32", num_kv_blocks=8, max_model_len=32, quantization="int4")
        )


@pytest.mark.parametrize("arch", ["qwen2moe", "olmoe"])
def test_a_moe_gguf_is_refused_naming_its_architecture(tmp_path, arch):
    """MoE GGUF files other than Qwen3-MoE (tests/engine/model/test_gguf_types.py) are refused up front."""
    import numpy as np
    from gguf import GGUFWriter

    from pagedserve.engine.model.path_source import gguf_summary

    path = tmp_path / "moe.gguf"
    writer = GGUFWriter(str(path), arch)
    writer.add_tensor("blk.0.ffn_gate_exps.weight", np.zeros((4, 8, 16), dtype=np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    with pytest.raises(ValueError, match=rf"unsupported GGUF architecture '{arch}'; supported: .*llama"):
        gguf_summary(path)
