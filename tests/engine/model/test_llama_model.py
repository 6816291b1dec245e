"""Our Llama-family model over a paged KV cache against transformers, on tiny random checkpoints."""

from __future__ import annotations

import json
from dataclasses import dataclass

import pytest
import torch
import torch.nn.functional as F
import transformers
from safetensors.torch import load_file, save_file

from pagedserve.engine.attention.metadata import AttentionMetadata
from pagedserve.engine.attention.selector import select_backend
from pagedserve.engine.model.kv_pool_size import kv_cache_bytes_per_block
from pagedserve.engine.model.loader import allocate_kv_caches, load_model, select_fused_ops

BLOCK_SIZE = 4
NUM_BLOCKS = 48
COMMON = dict(
    vocab_size=128,
    hidden_size=64,
    intermediate_size=96,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=256,
    initializer_range=0.1,
    rms_norm_eps=1e-5,
)
LLAMA3_ROPE = dict(
    rope_type="llama3", factor=8.0, low_freq_factor=1.0, high_freq_factor=4.0, original_max_position_embeddings=16
)


def _hf_config(kind: str) -> transformers.PretrainedConfig:
    if kind == "llama":
        return transformers.LlamaConfig(**COMMON, rope_theta=10000.0)
    if kind == "llama3_rope":
        return transformers.LlamaConfig(**COMMON, rope_theta=500000.0, rope_scaling=LLAMA3_ROPE)
    if kind == "qwen2":
        return transformers.Qwen2Config(**COMMON, tie_word_embeddings=True)
    if kind == "mistral":
        return transformers.MistralConfig(**COMMON, sliding_window=None)
    raise AssertionError(kind)


_HF_CLASSES = {
    "llama": transformers.LlamaForCausalLM,
    "llama3_rope": transformers.LlamaForCausalLM,
    "qwen2": transformers.Qwen2ForCausalLM,
    "mistral": transformers.MistralForCausalLM,
}


@dataclass
class Checkpoint:
    path: str
    hf: transformers.PreTrainedModel


def _save_checkpoint(kind: str, path, **save_kwargs) -> Checkpoint:
    torch.manual_seed(0)
    hf = _HF_CLASSES[kind](_hf_config(kind)).eval()
    with torch.no_grad():  # norms are 1 and biases 0 at init: make every tensor matter
        for name, param in hf.named_parameters():
            if "norm" in name:
                param.copy_(1 + 0.2 * torch.randn_like(param))
            elif name.endswith("bias"):
                param.copy_(0.2 * torch.randn_like(param))
    hf.save_pretrained(path, **save_kwargs)
    return Checkpoint(str(path), hf)


@pytest.fixture(scope="module", params=list(_HF_CLASSES))
def checkpoint(request, tmp_path_factory) -> Checkpoint:
    return _save_checkpoint(request.param, tmp_path_factory.mktemp(request.param))


def hf_logits(ckpt: Checkpoint, tokens: list[int]) -> torch.Tensor:
    with torch.no_grad():
        return ckpt.hf(torch.tensor([tokens])).logits[0].float()


@dataclass
class Chunk:
    """Run tokens[start:end] of a sequence whose blocks are `block_table`."""

    tokens: list[int]
    block_table: list[int]
    start: int
    end: int


def make_meta(chunks: list[Chunk]) -> tuple[AttentionMetadata, torch.Tensor, torch.Tensor]:
    """Metadata, input_ids and positions of one step; decodes (1-token chunks) must come first."""
    query_lens = [c.end - c.start for c in chunks]
    seq_lens = [c.end for c in chunks]
    positions = [p for c in chunks for p in range(c.start, c.end)]
    slots = [
        c.block_table[p // BLOCK_SIZE] * BLOCK_SIZE + p % BLOCK_SIZE for c in chunks for p in range(c.start, c.end)
    ]
    width = max(len(c.block_table) for c in chunks)
    tables = [c.block_table + [0] * (width - len(c.block_table)) for c in chunks]
    num_decodes = next((i for i, q in enumerate(query_lens) if q != 1), len(chunks))
    meta = AttentionMetadata(
        num_seqs=len(chunks),
        num_tokens=sum(query_lens),
        query_lens=query_lens,
        seq_lens=seq_lens,
        query_start_loc=torch.tensor([0] + query_lens, dtype=torch.int32).cumsum(0, dtype=torch.int32),
        seq_lens_tensor=torch.tensor(seq_lens, dtype=torch.int32),
        block_tables=torch.tensor(tables, dtype=torch.int32),
        slot_mapping=torch.tensor(slots, dtype=torch.int64),
        max_query_len=max(query_lens),
        max_seq_len=max(seq_lens),
        num_decodes=num_decodes,
    )
    input_ids = torch.tensor([t for c in chunks for t in c.tokens[c.start : c.end]])
    return meta, input_ids, torch.tensor(positions, dtype=torch.int64)


class PagedRunner:
    def __init__(self, ckpt: Checkpoint, dtype: torch.dtype = torch.float32, fused_ops=None) -> None:
        self.model = load_model(ckpt.path, dtype, "cpu", select_backend("cpu"), fused_ops=fused_ops)
        self.caches = allocate_kv_caches(self.model.spec, NUM_BLOCKS, BLOCK_SIZE, dtype, "cpu")

    def step(self, chunks: list[Chunk]) -> list[torch.Tensor]:
        """Logits [query_len, vocab] per chunk."""
        meta, input_ids, positions = make_meta(chunks)
        with torch.inference_mode():
            logits = self.model.compute_logits(self.model(input_ids, positions, self.caches, meta)).float()
        return list(logits.split(meta.query_lens))


def scrambled_blocks(generator: torch.Generator) -> list[int]:
    return torch.randperm(NUM_BLOCKS, generator=generator).tolist()


def random_tokens(n: int, generator: torch.Generator) -> list[int]:
    return torch.randint(0, 128, (n,), generator=generator).tolist()


def test_full_prefill_matches_hf(checkpoint):
    g = torch.Generator().manual_seed(1)
    tokens = random_tokens(23, g)
    (ours,) = PagedRunner(checkpoint).step([Chunk(tokens, scrambled_blocks(g)[:6], 0, 23)])
    ref = hf_logits(checkpoint, tokens)
    assert ref.abs().max() > 1.0  # the comparison is not vacuous
    torch.testing.assert_close(ours, ref, atol=1e-4, rtol=1e-4)


def run_chunked_then_decode(runner: PagedRunner, tokens: list[int], table: list[int]) -> torch.Tensor:
    """Prefill [0, 13) and [13, 29) as chunks, then decode one token at a time to the end."""
    out = runner.step([Chunk(tokens, table, 0, 13)]) + runner.step([Chunk(tokens, table, 13, 29)])
    for pos in range(29, len(tokens)):
        out += runner.step([Chunk(tokens, table, pos, pos + 1)])
    return torch.cat(out)


def test_chunked_prefill_then_decode_matches_hf(checkpoint):
    g = torch.Generator().manual_seed(2)
    tokens = random_tokens(40, g)
    table = scrambled_blocks(g)[:10]
    assert table != sorted(table)
    ours = run_chunked_then_decode(PagedRunner(checkpoint), tokens, table)
    torch.testing.assert_close(ours, hf_logits(checkpoint, tokens), atol=1e-4, rtol=1e-4)


def test_mixed_batch_matches_hf(checkpoint):
    g = torch.Generator().manual_seed(3)
    blocks = scrambled_blocks(g)
    a, b, c, d = (random_tokens(n, g) for n in (21, 10, 11, 18))
    ta, tb, tc, td = blocks[0:6], blocks[6:9], blocks[9:12], blocks[12:17]
    runner = PagedRunner(checkpoint)
    first = runner.step([Chunk(a, ta, 0, 20), Chunk(b, tb, 0, 9), Chunk(d, td, 0, 8)])
    # 2 decodes, 1 fresh prefill, 1 chunk after 8 tokens of context, in one step.
    mixed = runner.step([Chunk(a, ta, 20, 21), Chunk(b, tb, 9, 10), Chunk(c, tc, 0, 11), Chunk(d, td, 8, 18)])
    refs = [hf_logits(checkpoint, t) for t in (a, b, c, d)]
    for ours, ref in zip(first, (refs[0][:20], refs[1][:9], refs[3][:8])):
        torch.testing.assert_close(ours, ref, atol=1e-4, rtol=1e-4)
    for ours, ref in zip(mixed, (refs[0][20:], refs[1][9:], refs[2], refs[3][8:])):
        torch.testing.assert_close(ours, ref, atol=1e-4, rtol=1e-4)


def test_bfloat16_stays_close(checkpoint):
    g = torch.Generator().manual_seed(4)
    tokens = random_tokens(40, g)
    ours = run_chunked_then_decode(PagedRunner(checkpoint, torch.bfloat16), tokens, scrambled_blocks(g)[:10])
    ref = hf_logits(checkpoint, tokens)
    assert ours.dtype == torch.float32
    assert (ours - ref).abs().max() < 0.05 * ref.abs().max()
    assert (ours.argmax(-1) == ref.argmax(-1)).float().mean() > 0.9


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_fused_ops_give_identical_logits(checkpoint, dtype):
    """The CPU fused add+norm, RoPE and SiLU-and-mul round exactly like the torch code."""
    fused = select_fused_ops("cpu", dtype)
    if fused is None:
        pytest.skip("the CPU fused-ops extension could not be built here")
    g = torch.Generator().manual_seed(6)
    tokens = random_tokens(40, g)
    table = scrambled_blocks(g)[:10]
    plain = run_chunked_then_decode(PagedRunner(checkpoint, dtype), tokens, table)
    ours = run_chunked_then_decode(PagedRunner(checkpoint, dtype, fused), tokens, table)
    assert torch.equal(ours, plain)


def test_sharded_checkpoint_with_index(tmp_path):
    ckpt = _save_checkpoint("llama", tmp_path, max_shard_size="40KB")
    assert (tmp_path / "model.safetensors.index.json").is_file()
    g = torch.Generator().manual_seed(5)
    tokens = random_tokens(9, g)
    (ours,) = PagedRunner(ckpt).step([Chunk(tokens, [3, 1, 2], 0, 9)])
    torch.testing.assert_close(ours, hf_logits(ckpt, tokens), atol=1e-4, rtol=1e-4)


def test_kv_cache_helpers():
    config = _hf_config("llama").to_dict() | {"architectures": ["LlamaForCausalLM"]}
    caches = allocate_kv_caches(config, 5, 16, "bfloat16", "cpu")
    assert len(caches) == 2 and all(c.shape == (2, 5, 16, 2, 16) and not c.any() for c in caches)
    assert kv_cache_bytes_per_block(config, 16, torch.bfloat16) == sum(c.nbytes for c in caches) // 5


@pytest.fixture(scope="module")
def llama_dir(tmp_path_factory):
    return _save_checkpoint("llama", tmp_path_factory.mktemp("llama_err")).path


def _copy_dir(src, dst, config_update: dict | None = None, drop: str | None = None, add: str | None = None):
    config = json.loads(open(f"{src}/config.json").read()) | (config_update or {})
    (dst / "config.json").write_text(json.dumps(config))
    tensors = load_file(f"{src}/model.safetensors")
    if drop:
        del tensors[drop]
    if add:
        tensors[add] = torch.zeros(3)
    save_file(tensors, str(dst / "model.safetensors"))
    return dst


def test_loader_refuses_missing_tensor(llama_dir, tmp_path):
    path = _copy_dir(llama_dir, tmp_path, drop="model.layers.1.self_attn.k_proj.weight")
    with pytest.raises(ValueError, match=r"missing.*model\.layers\.1\.self_attn\.k_proj\.weight"):
        load_model(path, "float32", "cpu", select_backend("cpu"))


def test_loader_refuses_unexpected_tensor_but_ignores_inv_freq(llama_dir, tmp_path):
    path = _copy_dir(llama_dir, tmp_path, add="model.layers.0.self_attn.rotary_emb.inv_freq")
    load_model(path, "float32", "cpu", select_backend("cpu"))
    path = _copy_dir(llama_dir, tmp_path, add="model.layers.0.mlp.extra.weight")
    with pytest.raises(ValueError, match=r"unexpected.*mlp\.extra\.weight"):
        load_model(path, "float32", "cpu", select_backend("cpu"))


@pytest.mark.parametrize(
    ("update", "message"),
    [
        (
            {"architectures": ["GPT2LMHeadModel"]},
            r"GPT2LMHeadModel.*LlamaForCausalLM, MistralForCausalLM, Qwen2ForCausalLM",
        ),
        ({"rope_parameters": {"rope_type": "yarn", "factor": 2.0}}, r"rope type 'yarn'"),
        # a sliding window is served now (tests/engine/model/test_families.py): no refusal
    ],
)
def test_loader_refuses_unsupported_configs(llama_dir, tmp_path, update, message):
    path = _copy_dir(llama_dir, tmp_path, config_update=update)
    with pytest.raises(ValueError, match=message):
        load_model(path, "float32", "cpu", select_backend("cpu"))


def test_loader_refuses_pickle_only_checkpoints(llama_dir, tmp_path):
    (tmp_path / "config.json").write_text(open(f"{llama_dir}/config.json").read())
    (tmp_path / "pytorch_model.bin").write_bytes(b"not opened")
    with pytest.raises(ValueError, match=r"pytorch_model\.bin.*safetensors only"):
        load_model(tmp_path, "float32", "cpu", select_backend("cpu"))


def test_bfloat16_on_cpu_runs_packed_linears(checkpoint):
    """bf16 models on CPU run their projections and LM head through PackedLinear, or through
    UpcastLinear where the CPU has no bf16 dot products (the full-model closeness to HF is
    test_bfloat16_stays_close); logits match F.linear. Projections the fused decode layers read
    (pagedserve.engine.model.fused_decode) keep their plain weights instead of a packed copy."""
    from pagedserve.kernels.cpu_isa import cpu_has_bf16_dot
    from pagedserve.kernels.cpu_packed_linear import PackedLinear, SharedWeightLinear, packed_linear_supported
    from pagedserve.kernels.cpu_upcast_linear import UpcastLinear

    native = cpu_has_bf16_dot()
    if native and not packed_linear_supported():
        pytest.skip("no oneDNN bf16 linear here")
    expected = PackedLinear if native else UpcastLinear
    model = PagedRunner(checkpoint, torch.bfloat16).model
    layer = model.model.layers[0]
    projections = (layer.self_attn.qkv_proj, layer.self_attn.o_proj, layer.mlp.gate_up_proj, layer.mlp.down_proj)
    fused = model.fused_decode is not None and model.fused_decode.index[0] is not None
    assert all(isinstance(p, torch.nn.Linear if fused and native else expected) for p in projections)
    if model.spec.tie_word_embeddings and native:  # the head reads the embedding's own table
        assert isinstance(model.packed_lm_head, SharedWeightLinear)
        assert model.packed_lm_head.weight.data_ptr() == model.model.embed_tokens.weight.data_ptr()
    else:
        assert isinstance(model.packed_lm_head, expected)
    assert isinstance(PagedRunner(checkpoint, torch.float32).model.model.layers[0].mlp.down_proj, torch.nn.Linear)
    if model.spec.tie_word_embeddings:
        hidden = torch.randn(7, model.spec.hidden_size).bfloat16()
        want = F.linear(hidden, model.model.embed_tokens.weight)
        torch.testing.assert_close(model.compute_logits(hidden).float(), want.float(), rtol=1e-2, atol=2e-2)


def test_safetensors_are_read_tensor_by_tensor_as_safetensors_reads_them(tmp_path):
    """The loader's own reader (plain reads, no memory map: pagedserve.engine.model.loader) gives
    what safetensors gives, for every dtype; a truncated file is refused naming the tensor."""
    from safetensors.torch import load_file, save_file

    from pagedserve.engine.model.loader import iter_safetensors

    gen = torch.Generator().manual_seed(0)
    tensors = {
        "b": torch.randn(3, 5, generator=gen).bfloat16(),
        "a": torch.randn(7, generator=gen),
        "i": torch.arange(6, dtype=torch.int64).view(2, 3),
        "q": torch.randint(-128, 127, (4, 4), dtype=torch.int8, generator=gen),
        "h": torch.randn(2, 2, generator=gen).half(),
        "empty": torch.zeros(0, 4),
    }
    path = tmp_path / "model.safetensors"
    save_file(tensors, str(path))
    got = dict(iter_safetensors([path]))
    want = load_file(str(path))
    assert set(got) == set(want)
    for name, tensor in want.items():
        assert got[name].dtype == tensor.dtype and torch.equal(got[name], tensor), name
    path.write_bytes(path.read_bytes()[:-8])
    with pytest.raises(ValueError, match=r"model.safetensors: tensor \w+ is cut short"):
        dict(iter_safetensors([path]))
