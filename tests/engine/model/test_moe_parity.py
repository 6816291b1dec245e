"""Mixture-of-experts families against transformers, float32, through the real engine.

For each of Qwen2-MoE (gated shared expert, raw top-k weights, a dense layer), Qwen3-MoE
(per-head q/k norms, normalized top-k weights, `decoder_sparse_step`), Mixtral (top-k-then-
softmax, `block_sparse_moe` names; also with a 24-token sliding window, shorter than the longer
prompts) and OLMoE (whole-projection q/k norms): a tiny random config
is built here with transformers, saved as safetensors and run by the engine (scheduler, paged
KV cache, sampler). Greedy 32 tokens of prompts of 1 to ~100 tokens, all in one batch with
chunked prefill, are identical to transformers' `generate` on each prompt alone, and each step's
logits (a prompt alone, captured where the engine's sampler receives them) agree to 1e-4.
"""

from __future__ import annotations

import random

import pytest
import torch
import transformers

from pagedserve.engine.config.engine import EngineConfig
from pagedserve.engine.core.engine_core import EngineCore
from pagedserve.engine.request.request import Request
from pagedserve.engine.sampling.params import SamplingParams

NEW_TOKENS = 32
VOCAB = 512
COMMON = {
    "vocab_size": VOCAB,
    "hidden_size": 64,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "max_position_embeddings": 512,
    "initializer_range": 0.05,
    "tie_word_embeddings": False,
    "bos_token_id": None,
    "eos_token_id": None,
    "pad_token_id": None,
}
FAMILIES = {
    "qwen2_moe": lambda: transformers.Qwen2MoeConfig(
        **COMMON,
        num_hidden_layers=3,
        intermediate_size=96,
        num_experts=8,
        num_experts_per_tok=2,
        moe_intermediate_size=32,
        shared_expert_intermediate_size=48,
        norm_topk_prob=False,
        mlp_only_layers=[1],
    ),
    "qwen3_moe": lambda: transformers.Qwen3MoeConfig(
        **COMMON,
        num_hidden_layers=3,
        head_dim=16,
        intermediate_size=80,
        num_experts=8,
        num_experts_per_tok=3,
        moe_intermediate_size=32,
        norm_topk_prob=True,
        decoder_sparse_step=2,
    ),
    "mixtral": lambda: transformers.MixtralConfig(
        **COMMON, num_hidden_layers=2, intermediate_size=48, num_local_experts=4, num_experts_per_tok=2
    ),
    # Mixtral's optional window on every layer, shorter than the longer prompts (the families'
    # windowed attention, engine/attention/windowed.py, under experts).
    "mixtral_sliding": lambda: transformers.MixtralConfig(
        **COMMON,
        num_hidden_layers=2,
        intermediate_size=48,
        num_local_experts=4,
        num_experts_per_tok=2,
        sliding_window=24,
    ),
    "olmoe": lambda: transformers.OlmoeConfig(
        **COMMON, num_hidden_layers=2, intermediate_size=32, num_experts=8, num_experts_per_tok=2, norm_topk_prob=False
    ),
}


# The registered architecture each config above builds (tests/engine/model/test_families.py checks that
# every registered family is tested there or here).
ARCHITECTURES = {
    "qwen2_moe": "Qwen2MoeForCausalLM",
    "qwen3_moe": "Qwen3MoeForCausalLM",
    "mixtral": "MixtralForCausalLM",
    "olmoe": "OlmoeForCausalLM",
}


def make_prompts() -> list[list[int]]:
    rng = random.Random(0)
    return [[rng.randrange(VOCAB) for _ in range(n)] for n in (1, 5, 17, 40, 99)]


@pytest.fixture(scope="module", params=list(FAMILIES))
def family(request, tmp_path_factory):
    """(name, model folder, the transformers model) of one family's tiny random config."""
    name = request.param
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(FAMILIES[name]()).eval()
    assert type(model).__name__ == ARCHITECTURES[name.removesuffix("_sliding")]
    path = tmp_path_factory.mktemp(name) / "model"
    model.save_pretrained(path, safe_serialization=True)
    return name, path, model


def hf_generate(model, prompt: list[int]) -> tuple[list[int], torch.Tensor]:
    """transformers' greedy tokens and their logits `[NEW_TOKENS, vocab]` for one prompt."""
    ids = torch.tensor([prompt])
    with torch.inference_mode():
        out = model.generate(
            ids,
            attention_mask=torch.ones_like(ids),
            max_new_tokens=NEW_TOKENS,
            min_new_tokens=NEW_TOKENS,
            do_sample=False,
            output_logits=True,
            return_dict_in_generate=True,
            pad_token_id=0,
        )
    return out.sequences[0, len(prompt) :].tolist(), torch.cat(out.logits).float()


def make_engine(path, **options) -> EngineCore:
    return EngineCore(
        EngineConfig(model=str(path), dtype="float32", num_kv_blocks=128, block_size=16, max_model_len=256, **options)
    )


def run(engine: EngineCore, prompts: list[list[int]]) -> list[list[int]]:
    params = SamplingParams(max_tokens=NEW_TOKENS, temperature=0, ignore_eos=True)
    tokens: dict[str, list[int]] = {}
    for i, p in enumerate(prompts):
        tokens[f"r{i}"] = []
        engine.add_request(Request(f"r{i}", p, params))
    while engine.has_unfinished_requests():
        for out in engine.step():
            tokens[out.request_id].extend(out.new_token_ids)
    return [tokens[f"r{i}"] for i in range(len(prompts))]


def test_greedy_tokens_and_logits_match_transformers(family):
    _, path, model = family
    prompts = make_prompts()
    expected = [hf_generate(model, p) for p in prompts]
    # All prompts in one batch; a 48-token budget splits the long prompts (chunked prefill), so
    # steps mix prefill chunks and decode rows through the experts.
    batched = make_engine(path, max_num_batched_tokens=48)
    assert run(batched, prompts) == [tokens for tokens, _ in expected]
    assert batched.kv_manager.pool.get_num_free_blocks() == 128
    # Logits: one prompt at a time, so each step samples one row.
    engine = make_engine(path)
    model_ = engine.runner.model
    captured: list[torch.Tensor] = []
    compute_logits = model_.compute_logits

    def recording(hidden):
        logits = compute_logits(hidden)
        captured.append(logits.float().clone())
        return logits

    model_.compute_logits = recording
    for prompt, (tokens, logits) in zip(prompts, expected):
        captured.clear()
        assert run(engine, [prompt]) == [tokens]
        ours = torch.cat(captured)
        assert ours.shape == logits.shape == (NEW_TOKENS, VOCAB)
        torch.testing.assert_close(ours, logits, rtol=0, atol=1e-4)


def test_lora_adapters_are_refused_naming_the_model(family, tmp_path):
    """Experts take no LoRA adapter: a request with one is refused before it runs."""
    from pagedserve.engine.lora.request import LoRARequest

    _, path, model = family
    engine = make_engine(path)
    request = Request("r", [1, 2, 3], SamplingParams(max_tokens=2), lora=LoRARequest("a", str(tmp_path)))
    with pytest.raises(
        ValueError,
        match=rf"lora: LoRA adapters are not supported for mixture-of-experts "
        rf"models \({type(model).__name__}\)",
    ):
        engine.add_request(request)
    assert not engine.has_unfinished_requests()


def test_compile_always_leaves_a_moe_model_eager(family):
    """Experts' segment sizes are data: `compile: always` runs a MoE model eagerly, and right."""
    _, path, model = family
    engine = make_engine(path, compile="always")
    assert engine.runner.compiled is None
    prompt = make_prompts()[2]
    assert run(engine, [prompt]) == [hf_generate(model, prompt)[0]]
