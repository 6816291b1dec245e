"""Tensor parallelism through the offline API: greedy output of TP = 3 on the default model (9
query / 3 KV heads) and TP = 2 on a tiny random model (4 query heads, 1 KV head, replicated)
equal to TP = 1 in float32; a killed rank fails the next step naming it; sizes that do not
divide and options that do not combine are refused; each rank reads only its slices."""

from __future__ import annotations

import dataclasses
import json
import multiprocessing
import os
import re
import shutil
import signal

import pytest
import torch
from safetensors import safe_open

from pagedserve.engine import LLM, SamplingParams
from pagedserve.engine.attention.kv_dtype import KVCacheDtype
from pagedserve.engine.attention.metadata import AttentionMetadata
from pagedserve.engine.config.engine import EngineConfig
from pagedserve.engine.model.archive import ArchiveError, open_archive, write_archive
from pagedserve.engine.model.kv_pool_size import kv_pool_size
from pagedserve.engine.model.llama_spec import LlamaSpec
from pagedserve.engine.model.loader import read_config, safetensors_files
from pagedserve.engine.model.model_config import ModelConfig, ModelConfigError
from pagedserve.engine.model.registry import parse_config
from pagedserve.engine.model.sharding import TensorSlice, check_tensor_parallel, iter_rank_tensors, tensor_slice
from pagedserve.engine.parallel.driver import TensorParallelError
from pagedserve.engine.parallel.messages import decode, encode, forward_message, read_forward
from pagedserve.engine.platform.process_setup import resident_bytes

PROMPTS = ["1, 2, 3, 4,", "The capital of Germany is", "def fibonacci(n):"]
GREEDY = SamplingParams(max_tokens=8, temperature=0, logprobs=3)


@pytest.fixture(scope="module", autouse=True)
def keep_torch_threads():
    """An offline LLM sets its process's torch threads (a tensor-parallel one: its rank's
    share); give the next test module in this process its count back."""
    threads = torch.get_num_threads()
    yield
    torch.set_num_threads(threads)


@pytest.fixture(scope="module")
def mqa_model(tmp_path_factory, default_model_dir):
    """A tiny random Llama with 4 query heads and a single KV head, with the default model's
    tokenizer: at TP = 2 each rank holds 2 query heads and a copy of the KV head."""
    transformers = pytest.importorskip("transformers")
    path = tmp_path_factory.mktemp("tp-mqa") / "model"
    torch.manual_seed(0)
    config = transformers.LlamaConfig(
        hidden_size=64,
        intermediate_size=96,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=1,
        vocab_size=49152,
        max_position_embeddings=256,
    )
    transformers.LlamaForCausalLM(config).save_pretrained(path, safe_serialization=True)
    for name in ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja"):
        shutil.copy(default_model_dir / name, path / name)
    return path


@pytest.fixture(scope="module")
def tiny_pair(mqa_model):
    """(TP = 1, TP = 2) offline engines of the tiny model, float32."""
    options = {"dtype": "float32", "num_kv_blocks": 64, "max_model_len": 256}
    ref = LLM(mqa_model, num_threads=1, **options)
    tp = LLM(mqa_model, num_threads=2, tensor_parallel_size=2, **options)
    yield ref, tp
    tp.shutdown()


def tokens_and_logprobs(outputs):
    return [
        (
            [t for t in o.outputs[0].token_ids],
            [{tok: lp.logprob for tok, lp in step.items()} for step in o.outputs[0].logprobs],
        )
        for o in outputs
    ]


def assert_same_generation(ref_outputs, tp_outputs):
    for (ref_ids, ref_lps), (tp_ids, tp_lps) in zip(tokens_and_logprobs(ref_outputs), tokens_and_logprobs(tp_outputs)):
        assert tp_ids == ref_ids
        for ref_step, tp_step in zip(ref_lps, tp_lps):
            assert tp_step.keys() == ref_step.keys()
            for token, value in ref_step.items():
                assert tp_step[token] == pytest.approx(value, abs=1e-4)


def test_tp2_on_a_tiny_model_generates_what_tp1_does(tiny_pair):
    ref, tp = tiny_pair
    params = SamplingParams(max_tokens=12, temperature=0, logprobs=3, ignore_eos=True)
    assert_same_generation(ref.generate(PROMPTS, params), tp.generate(PROMPTS, params))


def test_tp2_replicates_the_single_kv_head(tiny_pair):
    tp = tiny_pair[1]
    runner = tp.engine.runner
    assert (runner.model.rank_spec.num_heads, runner.model.rank_spec.num_kv_heads) == (2, 1)
    assert runner.kv_caches[0].shape[3] == 1  # this rank's copy of the one KV head
    assert len(runner.tp.pids) == 1 and all(p.is_alive() for p in runner.tp.ranks)
    # Replicated heads cost their copies: a budget holds half the blocks it holds at TP = 1.
    one, two = (
        EngineConfig(model="m", dtype="float32", kv_cache_memory="1MiB", tensor_parallel_size=n) for n in (1, 2)
    )
    spec = runner.model.spec
    assert (
        kv_pool_size(two, runner.model.rank_spec, KVCacheDtype.AUTO)[1] * 2
        == kv_pool_size(one, spec, KVCacheDtype.AUTO)[1]
    )


def test_tp2_embeddings_equal_tp1(tiny_pair):
    ref, tp = tiny_pair
    for a, b in zip(ref.embed(PROMPTS), tp.embed(PROMPTS)):
        assert b == pytest.approx(a, abs=1e-5)


def test_sleep_stops_the_ranks_and_wake_starts_them_again(tiny_pair):
    ref, tp = tiny_pair
    params = SamplingParams(max_tokens=6, temperature=0, logprobs=3, ignore_eos=True)
    ranks = tp.engine.runner.tp.ranks
    tp.engine.sleep()
    assert [p.exitcode for p in ranks] == [0]
    tp.engine.wake()
    assert tp.engine.runner.tp.pids != [p.pid for p in ranks]
    assert_same_generation(ref.generate(PROMPTS, params), tp.generate(PROMPTS, params))


def test_a_workers_resident_memory_counts_its_ranks(tiny_pair):
    [pid] = tiny_pair[1].engine.runner.tp.pids
    rank = resident_bytes(pid)
    assert rank > 50 << 20  # a process with torch imported and its shard loaded
    with open("/proc/self/statm") as f:
        own = int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    assert resident_bytes() >= own + rank - (16 << 20)  # give or take what moved between the reads


def test_lora_is_refused_with_tensor_parallelism(tiny_pair, tmp_path):
    with pytest.raises(ValueError, match="lora: LoRA adapters are not supported with tensor_parallel_size=2"):
        tiny_pair[1].generate("hi", GREEDY, lora=tmp_path)


def test_default_model_tp3_generates_what_tp1_does(default_model_dir):
    options = {"dtype": "float32", "kv_cache_memory": "32MiB", "max_model_len": 512}
    ref = LLM(default_model_dir, num_threads=2, **options)
    expected = ref.generate(PROMPTS, GREEDY)
    ref_blocks = ref.engine.runner.num_blocks
    del ref
    tp = LLM(default_model_dir, num_threads=2, tensor_parallel_size=3, **options)
    try:
        assert_same_generation(expected, tp.generate(PROMPTS, GREEDY))
        assert expected[0].outputs[0].text.startswith(" 5, 6, 7")
        runner = tp.engine.runner
        # 9 query / 3 KV heads: 3 and 1 per rank; the same budget holds the same blocks.
        assert (runner.model.rank_spec.num_heads, runner.kv_caches[0].shape[3]) == (3, 1)
        assert runner.num_blocks == ref_blocks
        assert torch.get_num_threads() == 1  # 2 threads shared by 3 ranks: 1 each, never more
        ranks = runner.tp.ranks
    finally:
        tp.shutdown()
    assert [p.exitcode for p in ranks] == [0, 0]  # told to stop, they left cleanly


def test_killed_rank_fails_the_next_step_naming_it(mqa_model):
    llm = LLM(mqa_model, dtype="float32", num_kv_blocks=16, num_threads=2, tensor_parallel_size=2)
    try:
        assert llm.generate("1, 2, 3,", GREEDY)[0].outputs[0].token_ids
        [pid] = llm.engine.runner.tp.pids
        os.kill(pid, signal.SIGKILL)
        with pytest.raises(TensorParallelError, match=rf"rank 1 \(pid {pid}\) was killed by SIGKILL"):
            llm.generate("1, 2, 3,", GREEDY)
        with pytest.raises(TensorParallelError):  # broken for good: make a new LLM
            llm.generate("1, 2, 3,", GREEDY)
    finally:
        llm.shutdown()


def test_sizes_that_do_not_divide_are_refused_before_any_rank_starts(default_model_dir):
    before = set(multiprocessing.active_children())
    with pytest.raises(ValueError, match="tensor_parallel_size=2 does not divide the model's 9 query heads"):
        LLM(default_model_dir, tensor_parallel_size=2)
    assert set(multiprocessing.active_children()) == before


def test_a_failed_start_leaves_no_rank_behind(mqa_model, tmp_path):
    broken = tmp_path / "broken"
    shutil.copytree(mqa_model, broken)
    config = json.loads((broken / "config.json").read_text())
    (broken / "config.json").write_text(json.dumps({**config, "intermediate_size": 64}))  # not the weights' 96
    before = set(multiprocessing.active_children())
    with pytest.raises(
        ValueError, match=r"tensor model\.layers\.0\.mlp\.\w+_proj\.weight has shape \(\d+, \d+\), expected 64 along"
    ):
        LLM(broken, dtype="float32", num_kv_blocks=16, tensor_parallel_size=2)
    assert set(multiprocessing.active_children()) == before


def spec(**sizes) -> LlamaSpec:
    base = {
        "architecture": "LlamaForCausalLM",
        "vocab_size": 48,
        "hidden_size": 32,
        "intermediate_size": 24,
        "num_layers": 2,
        "num_heads": 4,
        "num_kv_heads": 2,
        "head_dim": 8,
        "rms_norm_eps": 1e-6,
        "max_position_embeddings": 64,
        "rope_theta": 10000.0,
        "rope_scaling": None,
        "tie_word_embeddings": True,
        "qkv_bias": False,
        "o_bias": True,
        "mlp_bias": True,
        "sliding_window": None,
    }
    return LlamaSpec(**{**base, **sizes})


@pytest.mark.parametrize(
    "sizes, size, named",
    [
        ({"num_heads": 9, "num_kv_heads": 3}, 2, "9 query heads"),
        ({"num_heads": 6, "num_kv_heads": 3}, 2, "3 KV heads"),
        ({"num_heads": 6, "num_kv_heads": 2}, 3, "2 KV heads (with fewer KV heads than ranks"),
        ({"intermediate_size": 25}, 2, "MLP intermediate size 25"),
        ({"vocab_size": 49}, 2, "vocabulary of 49 tokens"),
    ],
)
def test_check_names_the_size_that_does_not_divide(sizes, size, named):
    with pytest.raises(
        ValueError, match=rf"tensor_parallel_size={size} does not divide the model's .*{re.escape(named)}"
    ):
        check_tensor_parallel(spec(**sizes), size)
    check_tensor_parallel(spec(), 2)  # 4/2 heads, 24, 48 all divide


def test_tensor_slices_follow_the_heads():
    s = spec()  # 4 query heads, 2 KV heads of 8, at TP = 4: one query head, a KV head shared by 2 ranks
    assert tensor_slice("model.layers.0.self_attn.q_proj.weight", s, 3, 4) == TensorSlice(0, 24, 8, 32)
    assert [tensor_slice("model.layers.1.self_attn.k_proj.weight", s, r, 4) for r in range(4)] == [
        TensorSlice(0, 0, 8, 16),
        TensorSlice(0, 0, 8, 16),
        TensorSlice(0, 8, 8, 16),
        TensorSlice(0, 8, 8, 16),
    ]
    assert tensor_slice("model.layers.0.self_attn.o_proj.weight", s, 2, 4) == TensorSlice(1, 16, 8, 32)
    assert tensor_slice("model.layers.0.mlp.down_proj.weight", s, 1, 2) == TensorSlice(1, 12, 12, 24)
    assert tensor_slice("model.layers.0.mlp.up_proj.bias", s, 1, 2) == TensorSlice(0, 12, 12, 24)
    # A row-parallel bias is added once: rank 0 holds it, the others zeros.
    assert tensor_slice("model.layers.0.mlp.down_proj.bias", s, 0, 2) is None
    assert tensor_slice("model.layers.0.self_attn.o_proj.bias", s, 1, 2) == TensorSlice(zeros=True)
    assert tensor_slice("model.embed_tokens.weight", s, 1, 2) == TensorSlice(0, 24, 24, 48)
    assert tensor_slice("model.layers.0.input_layernorm.weight", s, 1, 2) is None


def test_a_rank_reads_exactly_its_slices(mqa_model):
    files = safetensors_files(mqa_model)
    model_spec = parse_config(read_config(mqa_model))
    with safe_open(str(files[0]), framework="pt") as f:
        for name, part in iter_rank_tensors(files, model_spec, 1, 2):
            full = f.get_tensor(name)
            where = tensor_slice(name, model_spec, 1, 2)
            if where is None:
                expected = full
            else:
                expected = full.narrow(where.dim, where.start, where.length)
            assert torch.equal(part, expected), name
    # the single KV head, copied on rank 1: rows 0..15 of k_proj
    assert tensor_slice("model.layers.0.self_attn.k_proj.weight", model_spec, 1, 2) == TensorSlice(0, 0, 16, 16)


def test_messages_round_trip_typed_tensors():
    meta = AttentionMetadata(
        num_seqs=2,
        num_tokens=3,
        query_lens=[1, 2],
        seq_lens=[5, 2],
        query_start_loc=torch.tensor([0, 1, 3], dtype=torch.int32),
        seq_lens_tensor=torch.tensor([5, 2], dtype=torch.int32),
        block_tables=torch.tensor([[3, 4], [7, 0]], dtype=torch.int32),
        slot_mapping=torch.tensor([52, 112, 113]),
        max_query_len=2,
        max_seq_len=5,
        num_decodes=1,
    )
    ids, positions, back = read_forward(
        decode(encode(forward_message(torch.tensor([9, 8, 7]), torch.tensor([4, 0, 1]), meta)), torch.device("cpu"))
    )
    assert ids.tolist() == [9, 8, 7] and positions.tolist() == [4, 0, 1]
    for field in dataclasses.fields(meta):
        a, b = getattr(meta, field.name), getattr(back, field.name)
        assert (torch.equal(a, b) and a.dtype == b.dtype) if isinstance(a, torch.Tensor) else a == b


@pytest.mark.parametrize(
    "option",
    [
        {"quantization": "int8"},
        {"kv_offload": {"cpu_size_gb": 1}},
        {"speculative": {"method": "ngram", "num_speculative_tokens": 2}},
    ],
)
def test_options_that_do_not_combine_are_refused(option):
    [name] = option
    with pytest.raises(ValueError, match=f"{name}: is not supported with tensor_parallel_size=2"):
        EngineConfig(model="m", tensor_parallel_size=2, **option)
    with pytest.raises(ValueError, match="tensor_parallel_size: must be >= 1, got 0"):
        EngineConfig(model="m", tensor_parallel_size=0)


def test_model_config_parallel_type_tp_sets_the_size():
    config = ModelConfig.from_dict({"parallelType": "tp", "parallelLevel": 3, "handler": {"dtype": "float32"}})
    assert config.engine_options() == {"dtype": "float32", "tensor_parallel_size": 3}
    assert ModelConfig.from_dict(config.resolved()).engine_options()["tensor_parallel_size"] == 3
    # TorchServe's vLLM example: parallelType custom, the size under vllm_engine_config.
    vllm = ModelConfig.from_dict(
        {"parallelType": "custom", "parallelLevel": 2, "handler": {"vllm_engine_config": {"tensor_parallel_size": 2}}}
    )
    assert vllm.engine_options() == {"tensor_parallel_size": 2}


@pytest.mark.parametrize(
    "data, message",
    [
        ({"parallelType": "pp", "parallelLevel": 2}, "parallelType: pp with parallelLevel 2 is not supported"),
        ({"parallelLevel": 2}, "parallelType: unset with parallelLevel 2 is not supported"),
        (
            {"parallelType": "tp", "parallelLevel": 2, "handler": {"tensor_parallel_size": 3}},
            "handler.tensor_parallel_size: 3 contradicts parallelLevel: 2",
        ),
        (
            {"parallelType": "tp", "parallelLevel": 2, "handler": {"kv_offload": {"cpu_size_gb": 1}}},
            "parallelLevel: kv_offload: is not supported with tensor_parallel_size=2",
        ),
    ],
)
def test_model_config_refuses_parallel_settings_it_cannot_run(data, message):
    with pytest.raises(ModelConfigError, match=message.replace("(", r"\(")):
        ModelConfig.from_dict(data)


def test_opening_an_archive_refuses_a_size_its_model_cannot_split(tmp_path):
    transformers = pytest.importorskip("transformers")
    model = tmp_path / "model"
    transformers.LlamaForCausalLM(
        transformers.LlamaConfig(
            hidden_size=24,
            intermediate_size=32,
            num_hidden_layers=1,
            num_attention_heads=3,
            num_key_value_heads=3,
            vocab_size=64,
        )
    ).save_pretrained(model, safe_serialization=True)
    config = tmp_path / "model-config.yaml"
    config.write_text("parallelType: tp\nparallelLevel: 2\n")
    archive = write_archive(model, tmp_path, model_name="three", version="1.0", config_file=config)
    with pytest.raises(ArchiveError, match="tensor_parallel_size=2 does not divide the model's 3 query heads"):
        open_archive(archive, tmp_path / "opened")
