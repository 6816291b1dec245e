"""Every supported family against transformers, through the real engine (scheduler, paged KV
cache, sampler, the fused decode layers): a tiny random-weight config per family, float32, greedy
32 tokens identical to transformers' and logprobs within 1e-4 of transformers' (log-softmax of
its logits) at every generated step. Where the family has a sliding window, prompts are longer than the window, the
budget forces chunked prefill and decodes share steps with prefill chunks."""

from __future__ import annotations

import pytest
import torch
import transformers

from pagedserve.engine.config.engine import EngineConfig
from pagedserve.engine.core.engine_core import EngineCore
from pagedserve.engine.model.registry import FAMILIES, supported_architectures
from pagedserve.engine.request.request import Request
from pagedserve.engine.sampling.params import SamplingParams
from pagedserve.kernels.cpu_native import load_native
from tests.engine.model.counting_stack import CountingStack

BLOCK_SIZE = 4
NEW_TOKENS = 32
WINDOW = 12
COMMON = dict(
    vocab_size=256,
    hidden_size=64,
    intermediate_size=96,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=16,
    max_position_embeddings=256,
    initializer_range=0.1,
    rms_norm_eps=1e-5,
    eos_token_id=None,
    bos_token_id=None,
    pad_token_id=None,
)


def _configs() -> dict[str, transformers.PretrainedConfig]:
    longrope = dict(
        rope_type="longrope",
        short_factor=[1.0 + 0.1 * i for i in range(8)],
        long_factor=[2.0 + 0.3 * i for i in range(8)],
    )
    return {
        "llama3": transformers.LlamaConfig(
            **COMMON,
            num_hidden_layers=2,
            rope_parameters=dict(
                rope_type="llama3",
                rope_theta=500000.0,
                factor=8.0,
                low_freq_factor=1.0,
                high_freq_factor=4.0,
                original_max_position_embeddings=16,
            ),
        ),
        "mistral": transformers.MistralConfig(**COMMON, num_hidden_layers=2, sliding_window=WINDOW),
        "qwen2": transformers.Qwen2Config(
            **COMMON, num_hidden_layers=3, use_sliding_window=True, sliding_window=WINDOW, max_window_layers=1
        ),
        "qwen3": transformers.Qwen3Config(
            **COMMON, num_hidden_layers=3, use_sliding_window=True, sliding_window=WINDOW, max_window_layers=2
        ),
        "gemma2": transformers.Gemma2Config(
            **COMMON,
            num_hidden_layers=4,
            sliding_window=WINDOW,
            query_pre_attn_scalar=24,
            attn_logit_softcapping=5.0,
            final_logit_softcapping=3.0,
        ),
        "gemma3": transformers.Gemma3TextConfig(
            **COMMON,
            num_hidden_layers=4,
            sliding_window=WINDOW,
            query_pre_attn_scalar=24,
            layer_types=["sliding_attention", "sliding_attention", "full_attention", "sliding_attention"],
            rope_parameters={
                "full_attention": {"rope_type": "linear", "factor": 4.0, "rope_theta": 100000.0},
                "sliding_attention": {"rope_type": "default", "rope_theta": 10000.0},
            },
        ),
        # Phi-3's LongRoPE with its short factors: every sequence stays below the original length.
        "phi3": transformers.Phi3Config(
            **{**COMMON, "max_position_embeddings": 512},
            num_hidden_layers=2,
            sliding_window=WINDOW,
            original_max_position_embeddings=128,
            rope_parameters={**longrope, "rope_theta": 10000.0},
        ),
    }


_HF_CLASSES = {
    "llama3": transformers.LlamaForCausalLM,
    "mistral": transformers.MistralForCausalLM,
    "qwen2": transformers.Qwen2ForCausalLM,
    "qwen3": transformers.Qwen3ForCausalLM,
    "gemma2": transformers.Gemma2ForCausalLM,
    "gemma3": transformers.Gemma3ForCausalLM,
    "phi3": transformers.Phi3ForCausalLM,
}


def test_every_registered_family_is_tested_here():
    """Here, or (mixture-of-experts families) in tests/engine/model/test_moe_parity.py."""
    from tests.engine.model.test_moe_parity import ARCHITECTURES as MOE_ARCHITECTURES

    tested = {cls.__name__ for cls in _HF_CLASSES.values()} | set(MOE_ARCHITECTURES.values())
    assert tested == set(supported_architectures())
    assert len(FAMILIES) == len(_HF_CLASSES) + len(MOE_ARCHITECTURES)


@pytest.fixture(scope="module", params=list(_HF_CLASSES))
def family(request, tmp_path_factory):
    name = request.param
    torch.manual_seed(0)
    config = _configs()[name]
    config._attn_implementation = "eager"  # transformers' reference path: windows and soft-caps
    hf = _HF_CLASSES[name](config).eval()
    with torch.no_grad():  # norms are 1 (Gemma: 0) at init: make every weight matter
        for pname, param in hf.named_parameters():
            if "norm" in pname:
                base = 0.0 if name.startswith("gemma") else 1.0
                param.copy_(base + 0.2 * torch.randn_like(param))
    path = tmp_path_factory.mktemp(name)
    hf.save_pretrained(path)
    return name, hf, path


def _prompts(name: str) -> list[list[int]]:
    gen = torch.Generator().manual_seed(1)
    lengths = (3, 29, 30) if name == "phi3" else (3, 37, 61)  # phi3: below its original 128 positions
    return [torch.randint(0, 256, (n,), generator=gen).tolist() for n in lengths]


def _hf_reference(hf, prompt: list[int]) -> tuple[list[int], torch.Tensor]:
    """Greedy tokens from generate(), and log-softmax of the logits of one uncached forward over
    prompt + tokens at each generated step."""
    ids = torch.tensor([prompt])
    with torch.no_grad():
        out = hf.generate(
            ids,
            attention_mask=torch.ones_like(ids),
            max_new_tokens=NEW_TOKENS,
            do_sample=False,
            min_new_tokens=NEW_TOKENS,
        )
        tokens = out[0, len(prompt) :].tolist()
        logits = hf(out[:, :-1]).logits[0, len(prompt) - 1 :].float()
    logprobs = torch.log_softmax(logits, dim=-1)
    assert logprobs.argmax(-1).tolist() == tokens  # the cached generate and the uncached forward agree
    return tokens, logprobs


def test_greedy_and_logprobs_match_transformers(family):
    name, hf, path = family
    prompts = _prompts(name)
    engine = EngineCore(
        EngineConfig(
            model=str(path),
            dtype="float32",
            block_size=BLOCK_SIZE,
            num_kv_blocks=96,
            max_num_batched_tokens=24,
            max_num_seqs=4,
            max_model_len=128,
        )
    )
    fused = engine.runner.model.fused_decode
    if load_native() is not None:  # decode steps run every layer fused (pagedserve.engine.model.fused_decode)
        assert fused is not None and fused.reasons == [None] * len(engine.runner.model.model.layers)
        fused.stack = CountingStack(fused.stack)
    params = SamplingParams(max_tokens=NEW_TOKENS, temperature=0, ignore_eos=True, logprobs=5)
    for i, prompt in enumerate(prompts):
        engine.add_request(Request(f"r{i}", prompt, params))
    tokens: dict[str, list[int]] = {f"r{i}": [] for i in range(len(prompts))}
    logprobs: dict[str, list] = {f"r{i}": [] for i in range(len(prompts))}
    while engine.has_unfinished_requests():
        for out in engine.step():
            tokens[out.request_id].extend(out.new_token_ids)
            logprobs[out.request_id].extend(out.new_logprobs or [])
    for i, prompt in enumerate(prompts):
        ref_tokens, ref_logprobs = _hf_reference(hf, prompt)
        assert tokens[f"r{i}"] == ref_tokens, f"{name} prompt {i} ({len(prompt)} tokens)"
        steps = logprobs[f"r{i}"]
        assert len(steps) == NEW_TOKENS
        for step, entry in enumerate(steps):
            ids = torch.tensor(entry.token_ids)
            got = torch.tensor(entry.logprobs)
            torch.testing.assert_close(got, ref_logprobs[step, ids], atol=1e-4, rtol=0)
    if fused is not None:  # the steps after the last prefill chunk took the fused path
        assert fused.stack.calls >= NEW_TOKENS // 2
    assert engine.kv_manager.pool.get_num_free_blocks() == 96
    if engine.runner.model.spec.sliding_window is not None:
        assert max(len(p) for p in prompts) > 2 * engine.runner.model.spec.sliding_window
