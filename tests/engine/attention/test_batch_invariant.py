"""Batch-invariant mode (EngineConfig.batch_invariant), bf16: the same 32 prompts give the same
tokens, and bit-identical logprobs, alone, in batches of 8 and of 32, with chunked prefill at two
chunk sizes, after a prefix-cache hit and after a restore from the LMCache tier; greedy and
seeded sampling. The layers are checked first: a GEMM row and an attention row against
themselves in every company, and the refusals of what the mode does not cover.
"""

from __future__ import annotations

import random

import pytest
import torch
import transformers

from pagedserve.engine.attention.batch_invariant import BatchInvariantAttentionBackend
from pagedserve.engine.attention.metadata import AttentionMetadata
from pagedserve.engine.config.engine import EngineConfig
from pagedserve.engine.config.schema import SchemaError
from pagedserve.engine.core.engine_core import EngineCore
from pagedserve.engine.model.layers.batch_invariant import BatchInvariantLinear
from pagedserve.engine.request.request import Request
from pagedserve.engine.sampling.params import SamplingParams
from pagedserve.kernels.cpu_paged_attention import load_cpu_kernels

BLOCK = 16
NUM_PROMPTS = 32
MAX_TOKENS = 6


@pytest.fixture(scope="module")
def small_model_dir(tmp_path_factory):
    """A small random Llama whose GEMMs are big enough for oneDNN to pick shape-dependent
    kernels (hidden 256, head_dim 64, vocab 512), 2 layers."""
    path = tmp_path_factory.mktemp("bi-llama")
    torch.manual_seed(1)
    config = transformers.LlamaConfig(
        vocab_size=512,
        hidden_size=256,
        intermediate_size=512,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=512,
        eos_token_id=None,
        bos_token_id=None,
    )
    transformers.LlamaForCausalLM(config).save_pretrained(path)
    return path


def _prompts() -> list[list[int]]:
    """32 prompts of 20-90 tokens; every fourth shares a 40-token prefix with the one before."""
    rng = random.Random(7)
    prompts: list[list[int]] = []
    for i in range(NUM_PROMPTS):
        if i % 4 == 3:
            prompts.append(prompts[-1][:40] + [rng.randrange(512) for _ in range(rng.randrange(5, 30))])
        else:
            prompts.append([rng.randrange(512) for _ in range(rng.randrange(20, 90))])
    return prompts


def _params(i: int) -> SamplingParams:
    if i % 3 == 2:  # seeded sampling: its own generator, so its draws follow it anywhere
        return SamplingParams(max_tokens=MAX_TOKENS, temperature=0.9, seed=100 + i, ignore_eos=True, logprobs=1)
    return SamplingParams(max_tokens=MAX_TOKENS, temperature=0, ignore_eos=True, logprobs=1)


Result = tuple[list[int], list[tuple[float, ...]]]


def _engine(model_dir, **options) -> EngineCore:
    defaults = {
        "model": str(model_dir),
        "dtype": "bfloat16",
        "batch_invariant": True,
        "num_kv_blocks": 256,
        "block_size": BLOCK,
        "max_num_batched_tokens": 4096,
        "max_num_seqs": NUM_PROMPTS,
        "num_threads": 1,
    }
    return EngineCore(EngineConfig(**(defaults | options)))


_ids = iter(range(10**9))


def _run(engine: EngineCore, indices: list[int]) -> tuple[dict[int, Result], dict[int, tuple[int, int]]]:
    """Generate prompts `indices` together; per prompt its tokens and logprobs, and its
    (prefix-cache, offload) hit tokens."""
    prompts = _prompts()
    names = {f"r{next(_ids)}": i for i in indices}
    for name, i in names.items():
        engine.add_request(Request(name, prompts[i], _params(i)))
    results: dict[int, Result] = {i: ([], []) for i in indices}
    hits: dict[int, tuple[int, int]] = {}
    while engine.has_unfinished_requests():
        for out in engine.step():
            i = names[out.request_id]
            results[i][0].extend(out.new_token_ids)
            results[i][1].extend(tuple(lp.logprobs) for lp in out.new_logprobs or [])
            hits[i] = (out.num_cached_tokens, out.num_external_cached_tokens)
    assert all(len(tokens) == MAX_TOKENS for tokens, _ in results.values())
    return results, hits


def _batches(engine: EngineCore, size: int) -> dict[int, Result]:
    out: dict[int, Result] = {}
    for start in range(0, NUM_PROMPTS, size):
        out |= _run(engine, list(range(start, start + size)))[0]
    return out


def test_linear_row_does_not_depend_on_its_company():
    torch.manual_seed(0)
    weight, bias = torch.randn(384, 256).bfloat16(), torch.randn(384).bfloat16()
    layer = BatchInvariantLinear(weight, bias)
    x = torch.randn(100, 256).bfloat16()
    full = layer(x)
    for start, length in [(0, 1), (5, 1), (3, 8), (17, 20), (31, 2), (40, 60), (0, 100)]:
        assert torch.equal(layer(x[start : start + length]), full[start : start + length]), (start, length)
    assert (full.float() - torch.nn.functional.linear(x, weight, bias).float()).abs().max() < 0.5


def _meta(query_lens: list[int], seq_lens: list[int], tables: list[list[int]]) -> AttentionMetadata:
    slots = []
    for q, s, table in zip(query_lens, seq_lens, tables):
        slots += [table[p // BLOCK] * BLOCK + p % BLOCK for p in range(s - q, s)]
    width = max(len(t) for t in tables)
    return AttentionMetadata(
        num_seqs=len(query_lens),
        num_tokens=sum(query_lens),
        query_lens=query_lens,
        seq_lens=seq_lens,
        query_start_loc=torch.tensor([0, *torch.tensor(query_lens).cumsum(0).tolist()], dtype=torch.int32),
        seq_lens_tensor=torch.tensor(seq_lens, dtype=torch.int32),
        block_tables=torch.tensor([t + [0] * (width - len(t)) for t in tables], dtype=torch.int32),
        slot_mapping=torch.tensor(slots, dtype=torch.long),
        max_query_len=max(query_lens),
        max_seq_len=max(seq_lens),
        num_decodes=next((i for i, q in enumerate(query_lens) if q != 1), len(query_lens)),
    )


@pytest.mark.parametrize(
    "kernel, window, softcap",
    [(True, None, None), (False, None, None), (True, 8, 30.0)],
    ids=["cpu-kernel", "torch", "window-softcap"],
)
def test_attention_row_is_the_same_in_a_prompt_a_chunk_and_a_decode(kernel, window, softcap):
    """A 40-token prompt attended whole, as chunks of 24 + 16, and token by token: every query
    row gives the same bits (a sliding window or soft-capped scores take the per-row torch path)."""
    kernels = load_cpu_kernels() if kernel else None
    if kernel and kernels is None:
        pytest.skip("the native CPU extension does not build here")
    torch.manual_seed(0)
    backend = BatchInvariantAttentionBackend(cpu_kernels=kernels)
    q, k, v = (torch.randn(40, n, 64).bfloat16() for n in (4, 2, 2))
    table = [3, 1, 7]

    def run(cuts: list[int]) -> torch.Tensor:
        cache = torch.zeros(2, 8, BLOCK, 2, 64, dtype=torch.bfloat16)
        outs, start = [], 0
        for end in cuts:
            meta = _meta([end - start], [end], [table])
            outs.append(backend.forward(q[start:end], k[start:end], v[start:end], cache, meta, 0.125, window, softcap))
            start = end
        return torch.cat(outs)

    whole = run([40])
    if window is not None:  # the window is honoured: the last row ignores all but 8 tokens
        q_last = q[-1].float().view(2, 2, 64)
        k_win, v_win = k[-8:].float().transpose(0, 1), v[-8:].float().transpose(0, 1)
        scores = torch.tanh(q_last @ k_win.transpose(1, 2) * 0.125 / softcap) * softcap
        expected = (scores.softmax(-1) @ v_win).reshape(4, 64)
        assert torch.allclose(whole[-1].float(), expected, atol=2e-2)
    assert torch.equal(run([24, 40]), whole)
    assert torch.equal(run(list(range(1, 41))), whole)


@pytest.mark.parametrize(
    "options, field",
    [
        ({"compile": "auto"}, "compile"),
        ({"tensor_parallel_size": 2}, "tensor_parallel_size"),
        ({"quantization": "int8"}, "quantization"),
        ({"attention_backend": "triton"}, "attention_backend"),
    ],
)
def test_refuses_what_it_does_not_cover(options, field):
    with pytest.raises(SchemaError, match=f"^{field}: is not supported with batch_invariant"):
        EngineConfig(model="m", batch_invariant=True, **options)


def test_same_tokens_alone_batched_chunked_and_after_cache_hits(small_model_dir, tmp_path):
    engine = _engine(small_model_dir, enable_prefix_caching=False)
    alone: dict[int, Result] = {}
    for i in range(NUM_PROMPTS):
        alone |= _run(engine, [i])[0]
    assert _batches(engine, 8) == alone
    assert _batches(engine, NUM_PROMPTS) == alone
    for chunk in (16, 48):  # every prompt is cut into chunks, mixed with the others' decodes
        assert (
            _batches(_engine(small_model_dir, enable_prefix_caching=False, max_num_batched_tokens=chunk), 32) == alone
        )

    cached = _engine(small_model_dir)  # prefix caching on: the second pass hits
    assert _batches(cached, NUM_PROMPTS) == alone
    again, hits = _run(cached, list(range(NUM_PROMPTS)))
    assert again == alone and all(h[0] >= BLOCK for h in hits.values())

    offload = _engine(
        small_model_dir,
        num_kv_blocks=64,
        kv_offload={"cpu_size_gb": 0.05, "chunk_size": BLOCK},
    )
    try:
        assert _batches(offload, 8) == alone  # stores every prompt's chunks
        assert offload.kv_manager.pool.reset_prefix_cache()
        restored, hits = _run(offload, list(range(8)))
        assert restored == {i: alone[i] for i in range(8)}
        # Each prompt restored from LMCache (prompt 3 also reuses prompt 2's blocks of this step).
        assert all(h[1] >= BLOCK and sum(h) >= (len(_prompts()[i]) - 1) // BLOCK * BLOCK for i, h in hits.items()), hits
    finally:
        offload.shutdown()


def test_model_config_takes_the_flag(tmp_path):
    from pagedserve.engine.model.model_config import ModelConfigError, load_model_config

    good, bad = tmp_path / "good.yaml", tmp_path / "bad.yaml"
    good.write_text("handler:\n  dtype: bfloat16\n  batch_invariant: true\n")
    bad.write_text("handler:\n  batch_invariant: true\n  compile: auto\n")
    assert load_model_config(good).handler["batch_invariant"] is True
    with pytest.raises(ModelConfigError, match="compile: is not supported with batch_invariant"):
        load_model_config(bad)
