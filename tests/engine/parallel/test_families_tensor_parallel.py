"""Tensor parallelism (TP = 2 on gloo, CPU) for the families beyond the Llama layout: Qwen3
(per-head q/k norms, sliding layers), Gemma 2 and 3 (Gemma norms, soft-caps, windows, embedding
scale), Phi-3 (a checkpoint with fused qkv_proj / gate_up_proj: each rank reads its slice of
each part) and OLMoE (q/k norms over whole projections, split with the heads; experts replicated,
each with a slice of its intermediate size). The tiny random configs of
tests/engine/model/test_families.py and test_moe_parity.py run through the real engine with two ranks:
greedy 32 tokens identical to transformers' and logprobs within 1e-4, prompts longer than the
window where the family has one."""

from __future__ import annotations

import pytest
import torch
import transformers

from pagedserve.engine.config.engine import EngineConfig
from pagedserve.engine.core.engine_core import EngineCore
from pagedserve.engine.model.sharding import tensor_slice
from pagedserve.engine.request.request import Request
from pagedserve.engine.sampling.params import SamplingParams
from tests.engine.model import test_families, test_moe_parity

FAMILIES = ("qwen3", "gemma2", "gemma3", "phi3", "olmoe")


@pytest.fixture(scope="module", autouse=True)
def keep_torch_threads():
    threads = torch.get_num_threads()
    yield
    torch.set_num_threads(threads)


@pytest.fixture(scope="module", params=FAMILIES)
def family(request, tmp_path_factory):
    name = request.param
    torch.manual_seed(0)
    if name == "olmoe":
        config = test_moe_parity.FAMILIES[name]()
        config.vocab_size = 256  # the families' prompts
    else:
        config = test_families._configs()[name]
    config._attn_implementation = "eager"
    hf = transformers.AutoModelForCausalLM.from_config(config).eval()
    with torch.no_grad():  # norms are 1 (Gemma: 0) at init: make every weight matter
        for pname, param in hf.named_parameters():
            if "norm" in pname:
                param.copy_((0.0 if name.startswith("gemma") else 1.0) + 0.2 * torch.randn_like(param))
    path = tmp_path_factory.mktemp(name)
    hf.save_pretrained(path)
    return name, hf, path


def test_tp2_matches_transformers(family):
    name, hf, path = family
    prompts = test_families._prompts(name)
    engine = EngineCore(
        EngineConfig(
            model=str(path),
            dtype="float32",
            block_size=test_families.BLOCK_SIZE,
            num_kv_blocks=96,
            max_num_batched_tokens=24,
            max_num_seqs=4,
            max_model_len=128,
            tensor_parallel_size=2,
            num_threads=2,
        )
    )
    try:
        assert engine.runner.tp is not None
        new = test_families.NEW_TOKENS
        params = SamplingParams(max_tokens=new, temperature=0, ignore_eos=True, logprobs=5)
        for i, prompt in enumerate(prompts):
            engine.add_request(Request(f"r{i}", prompt, params))
        tokens: dict[str, list[int]] = {f"r{i}": [] for i in range(len(prompts))}
        logprobs: dict[str, list] = {f"r{i}": [] for i in range(len(prompts))}
        while engine.has_unfinished_requests():
            for out in engine.step():
                tokens[out.request_id].extend(out.new_token_ids)
                logprobs[out.request_id].extend(out.new_logprobs or [])
    finally:
        engine.shutdown()
    for i, prompt in enumerate(prompts):
        ref_tokens, ref_logprobs = test_families._hf_reference(hf, prompt)
        assert tokens[f"r{i}"] == ref_tokens, f"{name} prompt {i} ({len(prompt)} tokens)"
        assert len(logprobs[f"r{i}"]) == new
        for step, entry in enumerate(logprobs[f"r{i}"]):
            got = torch.tensor(entry.logprobs)
            torch.testing.assert_close(got, ref_logprobs[step, torch.tensor(entry.token_ids)], atol=1e-4, rtol=0)


def test_a_fused_checkpoint_tensor_is_cut_per_part():
    """Phi-3's qkv_proj rows are q|k|v: rank 1 of 2 reads the second half of each part."""
    from pagedserve.engine.model.registry import parse_config

    spec = parse_config(test_families._configs()["phi3"])
    q, kv, inter = spec.num_heads * spec.head_dim, spec.num_kv_heads * spec.head_dim, spec.intermediate_size
    qkv = tensor_slice("model.layers.0.self_attn.qkv_proj.weight", spec, 1, 2)
    assert qkv.segments == ((q // 2, q // 2), (q + kv // 2, kv // 2), (q + kv + kv // 2, kv // 2))
    assert qkv.full == q + 2 * kv
    gate_up = tensor_slice("model.layers.0.mlp.gate_up_proj.weight", spec, 1, 2)
    assert gate_up.segments == ((inter // 2, inter // 2), (inter + inter // 2, inter // 2))
    down = tensor_slice("model.layers.0.mlp.down_proj.weight", spec, 1, 2)
    assert (down.dim, down.start, down.length) == (1, inter // 2, inter // 2)
