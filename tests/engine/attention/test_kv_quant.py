"""Quantized KV cache (`kv_cache_dtype` fp8_e4m3 / int8): the row format's round trip, attention
over a quantized paged cache (torch backend and the Triton kernel in its interpreter) against the
float64 reference over the de-quantized cache, the pool's size, and an engine on a tiny model."""

from __future__ import annotations

import pytest
import torch

from pagedserve.engine.attention.kv_dtype import KVCacheDtype
from pagedserve.engine.attention.kv_quant import dequantize_kv, quantize_kv
from pagedserve.engine.attention.selector import select_backend
from pagedserve.engine.attention.torch_backend import SHORT_CHUNK_TOKENS, TorchAttentionBackend
from pagedserve.engine.config.engine import EngineConfig
from pagedserve.engine.core.engine_core import EngineCore
from pagedserve.engine.model.kv_pool_size import kv_cache_bytes_per_block
from pagedserve.engine.request.request import Request
from pagedserve.engine.sampling.params import SamplingParams
from tests.engine.attention.test_attention_backends import (
    BLOCK_SIZE,
    HEAD_DIM,
    HEADS,
    KV_HEADS,
    MIXED,
    NUM_BLOCKS,
    make_meta,
    reference,
)

QUANTIZED = [KVCacheDtype.FP8_E4M3, KVCacheDtype.INT8]
# Triton's interpreter is slow: a smaller step (decode, whole prompt, chunk after cached context).
SMALL = [(1, 40), (1, 17), (9, 9), (20, 57), (5, 45)]


def _rows(g: torch.Generator) -> torch.Tensor:
    """Rows of 64 with a wide spread of magnitudes and an outlier per row, as real keys have."""
    x = torch.randn(512, 64, generator=g) * torch.logspace(-3, 2, 512)[:, None]
    x[:, 5] *= 20
    x[0] = 0  # an all-zero row (fresh padding) round-trips to zeros
    return x


@pytest.mark.parametrize("kind", QUANTIZED, ids=lambda k: k.value)
def test_round_trip_within_stated_error(kind):
    """int8: |error| <= max|row| * (1/254 + 2^-8); e4m3: <= |x| * 2^-4 + max|row| * 2^-8
    (half a step of the code, plus the scale's bf16 rounding and e4m3's subnormal step)."""
    x = _rows(torch.Generator().manual_seed(0))
    rows = quantize_kv(x.to(torch.bfloat16), kind)
    assert rows.dtype == torch.uint8 and rows.shape == (512, 66)
    back = dequantize_kv(rows, kind, torch.float32)
    xb = x.to(torch.bfloat16).float()
    amax = xb.abs().amax(dim=-1, keepdim=True)
    if kind is KVCacheDtype.INT8:
        bound = amax * (1 / 254 + 2**-8)
    else:
        bound = xb.abs() * 2**-4 + amax * 2**-8
    assert torch.all((back - xb).abs() <= bound)
    assert torch.equal(back[0], torch.zeros(64))
    # Not a loose bound that anything passes: the typical error is well above zero.
    assert (back - xb).abs().mean() > 0


def _quantized_cache(kind, g) -> torch.Tensor:
    values = torch.randn(2, NUM_BLOCKS, BLOCK_SIZE, KV_HEADS, HEAD_DIM, generator=g)
    return quantize_kv(values, kind)


def _triton(kind):
    pytest.importorskip("triton")
    return select_backend("cpu", "triton", kind)  # Triton's interpreter (tests/conftest.py)


@pytest.mark.parametrize("kind", QUANTIZED, ids=lambda k: k.value)
@pytest.mark.parametrize(
    ("make_backend", "dtype", "tol", "seqs"),
    [
        (lambda kind: TorchAttentionBackend(kv_dtype=kind), torch.float32, 1e-5, MIXED),
        (lambda kind: TorchAttentionBackend(kv_dtype=kind), torch.bfloat16, 2e-2, MIXED),
        (lambda kind: select_backend("cpu", "auto", kind), torch.float32, 1e-5, MIXED),  # the compiled kernel
        (lambda kind: select_backend("cpu", "auto", kind), torch.bfloat16, 2e-2, MIXED),
        (_triton, torch.float32, 1e-5, SMALL),
    ],
    ids=["torch-f32", "torch-bf16", "cpu-auto-f32", "cpu-auto-bf16", "triton-f32"],
)
def test_attention_reads_the_quantized_cache(kind, make_backend, dtype, tol, seqs):
    """Decodes in two length groups, prefill chunks, whole prompts and short chunks in one step:
    each output equals attention over the de-quantized cache, new tokens quantized as written."""
    g = torch.Generator().manual_seed(1)
    meta = make_meta(seqs, g)
    backend = make_backend(kind)
    assert backend.kv_dtype is kind
    cache = _quantized_cache(kind, g)
    q = torch.randn(meta.num_tokens, HEADS, HEAD_DIM, generator=g).to(dtype)
    k = torch.randn(meta.num_tokens, KV_HEADS, HEAD_DIM, generator=g).to(dtype)
    v = torch.randn(meta.num_tokens, KV_HEADS, HEAD_DIM, generator=g).to(dtype)
    out = backend.forward(q, k, v, cache, meta, 0.3)
    assert out.shape == q.shape and out.dtype == dtype
    written = cache[0].view(-1, KV_HEADS, HEAD_DIM + 2)[meta.slot_mapping]
    assert torch.equal(written, quantize_kv(k, kind))
    values = dequantize_kv(cache, kind, torch.float32)
    torch.testing.assert_close(out.double(), reference(q, values, meta, 0.3), atol=tol, rtol=tol)


@pytest.mark.parametrize("kind", QUANTIZED, ids=lambda k: k.value)
def test_cpu_backend_reads_the_quantized_cache_with_the_kernel(kind):
    """On CPU the backend's decodes are the compiled kernel's output on the quantized rows (not
    the gather + SDPA path), and its prefills see the same de-quantized values as the torch path."""
    from pagedserve.kernels.cpu_paged_attention import load_cpu_kernels, paged_decode_attention

    ext = load_cpu_kernels()
    if ext is None:
        pytest.skip("the CPU attention kernel could not be built here")
    g = torch.Generator().manual_seed(3)
    meta = make_meta([(1, 300), (1, 12), (1, 40)], g)
    cache = _quantized_cache(kind, g)
    q = torch.randn(meta.num_tokens, HEADS, HEAD_DIM, generator=g).to(torch.bfloat16)
    k = torch.randn(meta.num_tokens, KV_HEADS, HEAD_DIM, generator=g).to(torch.bfloat16)
    out = TorchAttentionBackend(cpu_kernels=ext, kv_dtype=kind).forward(q, k, k, cache, meta, 0.3)
    kernel = paged_decode_attention(
        ext, q, cache[0], cache[1], meta.block_tables, meta.seq_lens_tensor, 0.3, kind.value
    )
    assert torch.equal(out, kernel)
    # A whole prompt and a chunk after cached context (too long to run as kernel rows): the fused
    # gather + de-quantize pass gives bit for bit what the torch path (index_select + dequantize_kv) gives.
    meta = make_meta([(30, 30), (SHORT_CHUNK_TOKENS + 1, 50)], g)
    q = torch.randn(meta.num_tokens, HEADS, HEAD_DIM, generator=g).to(torch.bfloat16)
    k = torch.randn(meta.num_tokens, KV_HEADS, HEAD_DIM, generator=g).to(torch.bfloat16)
    fused = TorchAttentionBackend(cpu_kernels=ext, kv_dtype=kind).forward(q, k, k, cache.clone(), meta, 0.3)
    plain = TorchAttentionBackend(kv_dtype=kind).forward(q, k, k, cache.clone(), meta, 0.3)
    assert torch.equal(fused, plain)


@pytest.mark.parametrize("kind", [KVCacheDtype.AUTO, *QUANTIZED], ids=lambda k: k.value)
def test_float16_queries_take_the_torch_path(kind):
    """The compiled kernels take float32 / bfloat16 only: a float16 model on CPU still attends
    (through gather + SDPA) with the kernels loaded, equal to the float64 reference."""
    g = torch.Generator().manual_seed(4)
    meta = make_meta([(1, 40), (1, 9), (3, 20), (12, 12)], g)
    values = torch.randn(2, NUM_BLOCKS, BLOCK_SIZE, KV_HEADS, HEAD_DIM, generator=g)
    cache = quantize_kv(values, kind) if kind.quantized else values.half()
    q = torch.randn(meta.num_tokens, HEADS, HEAD_DIM, generator=g).half()
    k = torch.randn(meta.num_tokens, KV_HEADS, HEAD_DIM, generator=g).half()
    out = select_backend("cpu", "auto", kind).forward(q, k, k, cache, meta, 0.3)
    read = dequantize_kv(cache, kind, torch.float32) if kind.quantized else cache.float()
    torch.testing.assert_close(out.double(), reference(q, read, meta, 0.3), atol=5e-3, rtol=5e-3)


def test_backend_refuses_a_cache_of_the_wrong_kind():
    g = torch.Generator().manual_seed(2)
    meta = make_meta([(1, 5)], g)
    q, kv = torch.randn(1, HEADS, HEAD_DIM), torch.randn(1, KV_HEADS, HEAD_DIM)
    plain = torch.zeros(2, NUM_BLOCKS, BLOCK_SIZE, KV_HEADS, HEAD_DIM)
    with pytest.raises(ValueError, match="kv_cache_dtype int8"):
        TorchAttentionBackend(kv_dtype=KVCacheDtype.INT8).forward(q, kv, kv, plain, meta, 1.0)
    with pytest.raises(ValueError, match="kv_cache_dtype auto"):
        TorchAttentionBackend().forward(q, kv, kv, _quantized_cache(KVCacheDtype.INT8, g), meta, 1.0)


def test_config_checks_kv_cache_dtype():
    assert EngineConfig(model="m", kv_cache_dtype="FP8_E4M3").kv_cache_dtype == "fp8_e4m3"
    with pytest.raises(ValueError, match='kv_cache_dtype: must be one of "auto", "fp8_e4m3", "int8", got "fp16"'):
        EngineConfig(model="m", kv_cache_dtype="fp16")


def test_quantized_kv_block_is_about_half_of_bf16():
    """The default model's shapes (30 layers, 3 KV heads, head_dim 64): 66 bytes per row, not 128."""
    config = {
        "model_type": "llama",
        "hidden_size": 576,
        "num_attention_heads": 9,
        "num_key_value_heads": 3,
        "num_hidden_layers": 30,
        "intermediate_size": 1536,
        "vocab_size": 49152,
        "max_position_embeddings": 2048,
    }
    bf16 = kv_cache_bytes_per_block(config, 16, torch.bfloat16)
    for kind in QUANTIZED:
        assert kv_cache_bytes_per_block(config, 16, torch.bfloat16, kind) * 128 == bf16 * 66


def _run(engine: EngineCore, req_id: str, prompt: list[int]) -> tuple[list[int], int]:
    engine.add_request(Request(req_id, prompt, SamplingParams(max_tokens=8, temperature=0, ignore_eos=True)))
    tokens, cached = [], 0
    while engine.has_unfinished_requests():
        for out in engine.step():
            tokens += out.new_token_ids
            cached = max(cached, out.num_cached_tokens)
    return tokens, cached


def test_engine_with_quantized_kv(tiny_model_dir):
    """The same budget holds 3.2x the blocks (tiny model, float32: 10 bytes per row instead of 32);
    a prompt served again from the prefix cache gives the same greedy tokens as its first,
    uncached run (every prefill reads its keys/values back from the quantized cache)."""
    config = EngineConfig(model=str(tiny_model_dir), dtype="float32", kv_cache_dtype="int8", kv_cache_memory="1MiB")
    engine = EngineCore(config)
    runner = engine.runner
    assert runner.kv_caches[0].dtype == torch.uint8 and runner.kv_caches[0].shape[-1] == 8 + 2
    plain_blocks = config.kv_cache_memory // kv_cache_bytes_per_block(runner.model.spec, 16, torch.float32)
    assert abs(runner.num_blocks / plain_blocks - 3.2) < 0.01
    prompt = list(range(3, 40))
    first, cached_first = _run(engine, "a", prompt)
    again, cached_again = _run(engine, "b", prompt)
    assert cached_first == 0 and cached_again == 32
    assert again == first and len(first) == 8


def test_offload_keys_tell_kv_dtypes_apart(tiny_model_dir):
    """One disk folder shared by a bf16-KV and an fp8-KV engine of one model never mixes their chunks."""
    from pagedserve.engine.kv_offload.keys import model_fingerprint

    keys = {model_fingerprint(tiny_model_dir, torch.bfloat16, kind) for kind in ("auto", "fp8_e4m3", "int8")}
    assert len(keys) == 3
    assert model_fingerprint(tiny_model_dir, torch.bfloat16) == model_fingerprint(
        tiny_model_dir, torch.bfloat16, "auto"
    )
