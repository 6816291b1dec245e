"""The fused decode path (pagedserve.engine.model.fused_decode) on the real default model: the
same greedy tokens as the reference path in float32, at most 100 dispatcher calls per batch-1
decode step, and which layers and steps take it. Kernel-level checks against float64:
tests/kernels/test_decode_layer.py."""

from __future__ import annotations

import pytest
import torch

from pagedserve.engine import LLM, SamplingParams
from pagedserve.engine.model.fused_decode import MAX_ROWS, layer_refusal
from pagedserve.kernels.cpu_native import load_native
from tests.engine.model.counting_stack import CountingStack

pytestmark = pytest.mark.skipif(load_native() is None, reason="the native CPU extension cannot be built here")

PROMPTS = [
    "The capital of France is",
    "def fibonacci(n):",
    "Once upon a time, in a small village,",
]


def _greedy(llm: LLM, n: int) -> list[list[int]]:
    params = SamplingParams(max_tokens=n, temperature=0, ignore_eos=True)
    return [out.outputs[0].token_ids for out in llm.generate(PROMPTS, params)]


@pytest.fixture(scope="module")
def llm(default_model_dir):
    engine = LLM(default_model_dir, dtype="float32", kv_cache_memory="64MiB", max_model_len=512, num_threads=1)
    yield engine
    engine.shutdown()


def test_every_layer_of_the_default_model_is_fused(llm):
    fused = llm.engine.runner.model.fused_decode
    assert fused is not None
    assert fused.reasons == [None] * len(llm.engine.runner.model.model.layers)
    assert fused.stack.num_layers == len(fused.index)


def test_greedy_tokens_equal_the_reference_path_in_float32(llm, monkeypatch):
    """The fused path on this CPU's best instruction set, and with the AVX2 path forced (what an
    AVX2-only CPU runs), against the reference path (the layers' own modules)."""
    model = llm.engine.runner.model
    fused = model.fused_decode
    counting = CountingStack(fused.stack)
    fused.stack = counting
    try:
        with_fused = _greedy(llm, 16)
        calls = counting.calls
        monkeypatch.setenv("PAGEDSERVE_CPU_ISA", "avx2")  # read at every call; a cap, so scalar-only CPUs stay scalar
        avx2 = _greedy(llm, 16)
        monkeypatch.delenv("PAGEDSERVE_CPU_ISA")
        model.fused_decode = None
        reference = _greedy(llm, 16)
    finally:
        fused.stack = counting.stack
        model.fused_decode = fused
    assert calls >= 15  # every decode step (3 rows each) took the fused path, one call per step
    assert with_fused == reference
    assert avx2 == reference


@pytest.mark.parametrize("mode", ["int8", "int4"])
def test_quantized_models_fuse_every_layer_with_the_same_greedy_tokens(default_model_dir, mode):
    """int8 and int4 projections run inside the fused layers (the kernels their layers' own
    few-row paths run), so greedy tokens equal the reference path's in float32."""
    engine = LLM(
        default_model_dir,
        dtype="float32",
        quantization=mode,
        kv_cache_memory="64MiB",
        max_model_len=512,
        num_threads=1,
    )
    try:
        model = engine.engine.runner.model
        fused = model.fused_decode
        assert fused is not None and fused.reasons == [None] * len(model.model.layers)
        with_fused = _greedy(engine, 8)
        model.fused_decode = None
        reference = _greedy(engine, 8)
    finally:
        engine.shutdown()
    assert with_fused == reference


def test_a_batch_1_decode_step_costs_at_most_100_dispatcher_calls(llm):
    def ops(n: int) -> int:
        with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
            llm.generate([PROMPTS[0]], SamplingParams(max_tokens=n, temperature=0, ignore_eos=True))
        return sum(1 for e in prof.events() if "::" in e.name)

    per_step = (ops(9) - ops(1)) / 8
    assert 0 < per_step <= 100, per_step


def test_layers_the_kernel_does_not_cover_are_refused_with_a_reason(llm):
    model = llm.engine.runner.model
    layer = model.model.layers[0]
    spec = model.rank_spec
    assert layer_refusal(layer, torch.float32, spec.intermediate_size) is None
    assert layer_refusal(layer, torch.bfloat16, spec.intermediate_size).startswith("qkv_proj")
    assert layer_refusal(layer, torch.float32, spec.intermediate_size + 1) == "an MLP of another width"
    attn = layer.self_attn
    window = attn.window
    attn.window, attn.qk_norm_full = 64, True
    try:
        assert layer_refusal(layer, torch.float32, spec.intermediate_size) == "q/k norms over whole projections"
        attn.qk_norm_full = False
        assert layer_refusal(layer, torch.float32, spec.intermediate_size) is None  # sliding windows are fused
    finally:
        attn.window, attn.qk_norm_full = window, False


def test_steps_with_prefills_or_many_rows_take_the_reference_path(llm):
    from pagedserve.engine.attention.metadata import AttentionMetadata

    fused = llm.engine.runner.model.fused_decode
    ids = torch.zeros(3, dtype=torch.long)

    def meta(query_lens: list[int], num_decodes: int) -> AttentionMetadata:
        n = len(query_lens)
        return AttentionMetadata(
            n,
            sum(query_lens),
            query_lens,
            list(query_lens),
            torch.zeros(n + 1, dtype=torch.int32),
            torch.ones(n, dtype=torch.int32),
            torch.zeros(n, 1, dtype=torch.int32),
            torch.zeros(sum(query_lens), dtype=torch.long),
            max(query_lens),
            max(query_lens),
            num_decodes,
        )

    assert fused.applies(ids, meta([1, 1, 1], 3), None)
    assert not fused.applies(ids, meta([1, 2], 1), None)  # a prefill chunk in the step
    assert not fused.applies(ids, meta([1, 1, 1], 3), object())  # LoRA rows
    big = MAX_ROWS + 1
    assert not fused.applies(torch.zeros(big, dtype=torch.long), meta([1] * big, big), None)
