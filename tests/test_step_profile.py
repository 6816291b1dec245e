"""benchmarks/step_profile.py on a tiny random-weight model: the parts of a run add up to its
wall time, each timed part saw work, and detaching leaves the engine's own code in place."""

from __future__ import annotations

import importlib.util
import shutil
import time
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


def _load_step_profile():
    spec = importlib.util.spec_from_file_location("step_profile", ROOT / "benchmarks" / "step_profile.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.fixture(scope="module")
def tiny_llm(tmp_path_factory, default_model_dir):
    transformers = pytest.importorskip("transformers")
    from pagedserve.engine import LLM

    model = tmp_path_factory.mktemp("tiny-profile") / "model"
    config = transformers.LlamaConfig(
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=2,
        num_key_value_heads=2,
        vocab_size=49152,
        max_position_embeddings=256,
    )
    transformers.LlamaForCausalLM(config).save_pretrained(model, safe_serialization=True)
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(default_model_dir / name, model / name)
    llm = LLM(model, dtype="float32", num_threads=1, kv_cache_memory="8MiB")
    yield llm
    llm.shutdown()


def test_the_breakdown_adds_up_and_detach_restores_the_engine(tiny_llm):
    from pagedserve.engine import SamplingParams
    from pagedserve.engine.core.output_processor import OutputProcessor

    step_profile = _load_step_profile()
    original = OutputProcessor.process_outputs
    params = SamplingParams(max_tokens=5, ignore_eos=True, temperature=0)
    with step_profile.StepProfile().attach(tiny_llm) as timers:
        start = time.perf_counter()
        outs = tiny_llm.generate([[100 + i for i in range(20)], [7, 8, 9]], params)
        wall = time.perf_counter() - start
    assert [len(o.outputs[0].token_ids) for o in outs] == [5, 5]
    parts = timers.breakdown(wall)
    assert list(parts) == list(step_profile.PARTS)
    assert sum(parts.values()) == pytest.approx(wall)
    assert timers.steps >= 5
    for name in (
        "schedule",
        "prepare inputs",
        "forward: matmul",
        "forward: attention",
        "forward: rest",
        "logits",
        "sample",
        "detokenize",
    ):
        assert parts[name] > 0, name
    # Detached: the engine's own methods again, and nothing more is counted.
    assert OutputProcessor.process_outputs is original
    assert "schedule" not in vars(tiny_llm.engine.scheduler)
    assert "forward" not in vars(tiny_llm.engine.runner.model)
    before = dict(timers.seconds)
    tiny_llm.generate([[1, 2, 3]], params)
    assert timers.seconds == before
