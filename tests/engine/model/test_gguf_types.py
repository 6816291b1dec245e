"""GGUF files of each type users bring — Q4_K_M, Q5_K_M, Q6_K, Q8_0, Q4_0, Q4_1 — load and
match a de-quantizing reference.

A tiny random Qwen3 (llama.cpp's tensor names, the first 2,048 tokens of the default model's GGUF
tokenizer: a GGUF reader parses every token and merge one by one, so the full 49,152-token
vocabulary cost seconds per read, five reads per file) is written as a GGUF of the type, the way llama.cpp mixes types in it (`_M`: Q6_K for attn_v and ffn_down,
the base type elsewhere; norms F32). Q8_0 / Q4_0 / Q4_1 blocks come from the `gguf` package's
quantizers; it has none for the K-quants (Q4_K, Q5_K, Q6_K), so theirs are random codes with
half-float scales chosen to give weights of the usual size (their de-quantizers are the
`gguf` package's, the reference's too). The file is registered as a path would be
(pagedserve.engine.model.path_source: checked, de-quantized to float32, archived) and run through
the engine (scheduler, paged cache, sampler); the reference is transformers' Qwen3 holding the
`gguf` package's de-quantization of every tensor: greedy 32 tokens identical, logprobs within
1e-4. The archive's description says the weights are de-quantized, naming the GGUF's types.
"""

from __future__ import annotations

import json
import shutil

import numpy as np
import pytest
import torch
import transformers

from pagedserve.engine.config.engine import EngineConfig
from pagedserve.engine.core.engine_core import EngineCore
from pagedserve.engine.request.request import Request
from pagedserve.engine.sampling.params import SamplingParams

gguf = pytest.importorskip("gguf")

NEW_TOKENS = 32
# K-quant rows hold whole super-blocks of 256 inputs. head_dim 128: transformers reads a qwen3
# GGUF's head_dim as Qwen3Config's default, not from `attention.key_length`.
HIDDEN, LAYERS, HEADS, KV_HEADS, HEAD_DIM, INTER, VOCAB = 256, 2, 4, 2, 128, 256, 2048
# file type -> (type of most 2-D tensors, type of attn_v / ffn_down)
FILE_TYPES = {
    "Q4_K_M": ("Q4_K", "Q6_K"),
    "Q5_K_M": ("Q5_K", "Q6_K"),
    "Q6_K": ("Q6_K", "Q6_K"),
    "Q8_0": ("Q8_0", "Q8_0"),
    "Q4_0": ("Q4_0", "Q4_0"),
    "Q4_1": ("Q4_1", "Q4_1"),
}
# byte offsets of a K-quant super-block's half-float scales (Q4_K/Q5_K: d and dmin; Q6_K: d),
# their range (weights of std ~0.1), and (Q4_K/Q5_K) the code that maps to zero
_K_SCALES = {"Q4_K": (0, 4, 6e-3, 1e-2, 7), "Q5_K": (0, 4, 3e-3, 5e-3, 15), "Q6_K": (208, 210, 6e-5, 1e-4, 0)}


@pytest.fixture(scope="module")
def tokenizer_fields() -> list[tuple[str, object, list]]:
    """The default model's GGUF tokenizer cut to its first VOCAB tokens (special tokens and
    bytes first, then merges in rank order) and the merges among them: (key, value, types)."""
    from pagedserve.engine.model.default_model import default_gguf_path

    try:
        path = default_gguf_path()
    except FileNotFoundError as exc:
        pytest.skip(str(exc))
    reader = gguf.GGUFReader(str(path))
    fields = {k: f for k, f in reader.fields.items() if k.startswith("tokenizer.")}
    tokens = fields["tokenizer.ggml.tokens"].contents()[:VOCAB]
    kept = set(tokens)
    merges = [
        m
        for m in fields["tokenizer.ggml.merges"].contents()
        if set(m.split(" ")) <= kept and m.replace(" ", "") in kept
    ]
    cut = {
        "tokenizer.ggml.tokens": tokens,
        "tokenizer.ggml.token_type": fields["tokenizer.ggml.token_type"].contents()[:VOCAB],
        "tokenizer.ggml.merges": merges,
    }
    return [(k, cut.get(k, f.contents()), f.types) for k, f in fields.items()]


def _add_tokenizer(writer, tokenizer_fields) -> None:
    for key, value, types in tokenizer_fields:
        writer.add_key_value(key, value, types[0], types[1] if len(types) > 1 else None)


def _blocks(data: np.ndarray, kind: str, rng: np.random.Generator) -> np.ndarray:
    """`data` [rows, cols] as `kind` blocks: quantized by gguf, or (K-quants, which gguf cannot
    make) random codes with half-float scales giving zero-centred weights of std ~0.1 (Q6_K's
    codes are centred by its format; Q4_K / Q5_K sub-block mins are set to `zero` x scale)."""
    qtype = gguf.GGMLQuantizationType[kind]
    if kind not in _K_SCALES:
        return gguf.quants.quantize(data, qtype)
    per_block, nbytes = gguf.GGML_QUANT_SIZES[qtype]
    rows, blocks = data.shape[0], data.shape[1] // per_block
    raw = rng.integers(0, 256, size=(rows, blocks, nbytes), dtype=np.uint8)
    start, stop, low, high, zero = _K_SCALES[kind]
    scales = rng.uniform(low, high, size=(rows, blocks, (stop - start) // 2)).astype(np.float16)
    raw[..., start:stop] = scales.view(np.uint8)
    if zero:  # d == dmin; 8 sub-blocks: 6-bit scale sc in 1..4 and min m = zero * sc, packed in 12 bytes
        raw[..., 2:4] = raw[..., 0:2]
        sc = rng.integers(1, 5, size=(rows, blocks, 8))
        m = zero * sc
        packed = np.zeros((rows, blocks, 12), dtype=np.int64)
        packed[..., 0:4] = sc[..., :4] | ((sc[..., 4:] >> 4) << 6)
        packed[..., 4:8] = m[..., :4] | ((m[..., 4:] >> 4) << 6)
        packed[..., 8:12] = (sc[..., 4:] & 0xF) | ((m[..., 4:] & 0xF) << 4)
        raw[..., 4:16] = packed.astype(np.uint8)
    return raw.reshape(rows, blocks * nbytes)


def write_gguf(path, hf: transformers.PreTrainedModel, file_type: str, tokenizer_fields) -> None:
    """`hf`'s weights as a llama.cpp-style qwen3 GGUF of `file_type`."""
    writer = gguf.GGUFWriter(str(path), "qwen3")
    writer.add_file_type(gguf.LlamaFileType[f"MOSTLY_{file_type}"])
    writer.add_context_length(256)
    writer.add_embedding_length(HIDDEN)
    writer.add_block_count(LAYERS)
    writer.add_feed_forward_length(INTER)
    writer.add_head_count(HEADS)
    writer.add_head_count_kv(KV_HEADS)
    writer.add_key_length(HEAD_DIM)
    writer.add_value_length(HEAD_DIM)
    writer.add_rope_freq_base(1000000.0)
    writer.add_layer_norm_rms_eps(1e-6)
    _add_tokenizer(writer, tokenizer_fields)
    names = gguf.get_tensor_name_map(gguf.MODEL_ARCH.QWEN3, LAYERS)
    base, special = FILE_TYPES[file_type]
    rng = np.random.default_rng(len(file_type))
    for name, tensor in hf.state_dict().items():
        if name == "lm_head.weight":
            continue  # tied
        gname = names.get_name(name, try_suffixes=(".weight",))
        data = tensor.float().numpy()
        if data.ndim == 2:
            kind = special if ("attn_v" in gname or "ffn_down" in gname) else base
            writer.add_tensor(gname, _blocks(data, kind, rng), raw_dtype=gguf.GGMLQuantizationType[kind])
        else:
            writer.add_tensor(gname, data)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()


def dequantized_reference(path, config: transformers.Qwen3Config) -> transformers.PreTrainedModel:
    """transformers' Qwen3 holding the gguf package's de-quantization of every tensor."""
    reader = gguf.GGUFReader(str(path))
    tensors = {t.name: t for t in reader.tensors}
    names = gguf.get_tensor_name_map(gguf.MODEL_ARCH.QWEN3, LAYERS)
    model = transformers.Qwen3ForCausalLM(config).eval()
    with torch.no_grad():
        for name, param in model.named_parameters():
            if name == "lm_head.weight":
                continue
            t = tensors[names.get_name(name, try_suffixes=(".weight",))]
            values = gguf.quants.dequantize(t.data, t.tensor_type)
            param.copy_(torch.from_numpy(np.ascontiguousarray(values)).reshape(param.shape))
    model.tie_weights()
    return model


@pytest.fixture(scope="module")
def hf_config() -> transformers.Qwen3Config:
    return transformers.Qwen3Config(
        vocab_size=VOCAB,
        hidden_size=HIDDEN,
        intermediate_size=INTER,
        num_hidden_layers=LAYERS,
        num_attention_heads=HEADS,
        num_key_value_heads=KV_HEADS,
        head_dim=HEAD_DIM,
        tie_word_embeddings=True,
        initializer_range=0.05,
        rope_theta=1000000.0,
        rms_norm_eps=1e-6,
    )


@pytest.fixture(scope="module")
def hf_qwen3(hf_config):
    torch.manual_seed(0)
    model = transformers.Qwen3ForCausalLM(hf_config).eval()
    with torch.no_grad():
        for name, param in model.named_parameters():
            if "norm" in name:
                param.copy_(1 + 0.2 * torch.randn_like(param))
    return model


@pytest.mark.parametrize("file_type", list(FILE_TYPES))
def test_a_gguf_of_each_type_loads_and_matches_its_dequantized_reference(
    hf_qwen3, hf_config, file_type, tmp_path, tokenizer_fields
):
    from pagedserve.engine.model.path_source import archive_from_path, describe_model

    # Its own archive cache (not PAGEDSERVE_CACHE_DIR, which would also move the CPU extension's
    # build folder and rebuild it: minutes).
    path = tmp_path / f"tiny-qwen3-{file_type}.gguf"
    write_gguf(path, hf_qwen3, file_type, tokenizer_fields)
    base, special = FILE_TYPES[file_type]
    try:
        model_dir = archive_from_path(path, cache_dir=tmp_path / "cache")
        info = json.loads((model_dir / "pagedserve_source_info.json").read_text())
        quantized = {base: 5 * LAYERS + 1, special: 2 * LAYERS} if base != special else {base: 7 * LAYERS + 1}
        assert info["gguf"]["tensor_types"] == {"F32": 4 * LAYERS + 1, **quantized}
        weights = describe_model(model_dir)["weights"]
        assert weights == f"de-quantized to float32 at load (GGUF {', '.join(sorted({'F32', base, special}))})"

        reference = dequantized_reference(path, hf_config)
        prompt = torch.randint(0, VOCAB, (40,), generator=torch.Generator().manual_seed(1)).tolist()
        with torch.no_grad():
            out = reference.generate(
                torch.tensor([prompt]),
                attention_mask=torch.ones(1, 40, dtype=torch.long),
                max_new_tokens=NEW_TOKENS,
                min_new_tokens=NEW_TOKENS,
                do_sample=False,
            )
            logprobs = torch.log_softmax(reference(out[:, :-1]).logits[0, len(prompt) - 1 :].float(), -1)
        expected = out[0, len(prompt) :].tolist()

        engine = EngineCore(
            EngineConfig(
                model=str(model_dir),
                dtype="float32",
                block_size=4,
                num_kv_blocks=32,
                max_num_batched_tokens=16,
                max_model_len=128,
            )
        )
        engine.add_request(
            Request("q", prompt, SamplingParams(max_tokens=NEW_TOKENS, temperature=0, ignore_eos=True, logprobs=3))
        )
        tokens, steps = [], []
        while engine.has_unfinished_requests():
            for o in engine.step():
                tokens += o.new_token_ids
                steps += o.new_logprobs or []
        assert tokens == expected
        assert len(set(expected)) > 3  # not a degenerate repetition
        for i, entry in enumerate(steps):
            torch.testing.assert_close(torch.tensor(entry.logprobs), logprobs[i, entry.token_ids], atol=1e-4, rtol=0)
    finally:
        shutil.rmtree(tmp_path / "cache", ignore_errors=True)  # ~7 MB of float32 weights


MOE_EXPERTS, MOE_INTER = 4, 768  # transformers reads no expert size from a qwen3moe GGUF: its default, 768


def test_a_moe_gguf_loads_and_matches_its_dequantized_reference(tmp_path, tokenizer_fields):
    """A Qwen3-MoE GGUF (experts as 3-D `ffn_{gate,up,down}_exps` tensors, Q8_0) is registered
    from its path (each expert's projections split out of the 3-D tensors) and matches
    transformers' Qwen3-MoE holding the gguf package's de-quantization."""
    from pagedserve.engine.model.path_source import archive_from_path

    config = transformers.Qwen3MoeConfig(
        vocab_size=VOCAB,
        hidden_size=HIDDEN,
        intermediate_size=INTER,
        moe_intermediate_size=MOE_INTER,
        num_hidden_layers=LAYERS,
        num_attention_heads=HEADS,
        num_key_value_heads=KV_HEADS,
        head_dim=HEAD_DIM,
        num_experts=MOE_EXPERTS,
        num_experts_per_tok=2,
        norm_topk_prob=True,
        tie_word_embeddings=True,
        initializer_range=0.05,
        rope_theta=1000000.0,
        rms_norm_eps=1e-6,
    )
    path = tmp_path / "tiny-qwen3moe-Q8_0.gguf"
    writer = gguf.GGUFWriter(str(path), "qwen3moe")
    writer.add_file_type(gguf.LlamaFileType.MOSTLY_Q8_0)
    writer.add_context_length(256)
    writer.add_embedding_length(HIDDEN)
    writer.add_block_count(LAYERS)
    writer.add_feed_forward_length(INTER)
    writer.add_expert_feed_forward_length(MOE_INTER)
    writer.add_expert_count(MOE_EXPERTS)
    writer.add_expert_used_count(2)
    writer.add_head_count(HEADS)
    writer.add_head_count_kv(KV_HEADS)
    writer.add_key_length(HEAD_DIM)
    writer.add_value_length(HEAD_DIM)
    writer.add_rope_freq_base(1000000.0)
    writer.add_layer_norm_rms_eps(1e-6)
    _add_tokenizer(writer, tokenizer_fields)
    rng = np.random.default_rng(5)
    q8 = gguf.GGMLQuantizationType.Q8_0

    def add(name: str, shape: tuple[int, ...], quantize: bool = True, base: float = 0.0) -> None:
        data = (base + 0.05 * rng.standard_normal(shape)).astype(np.float32)
        if quantize:
            writer.add_tensor(name, gguf.quants.quantize(data, q8), raw_dtype=q8)
        else:
            writer.add_tensor(name, data)

    add("token_embd.weight", (VOCAB, HIDDEN))
    add("output_norm.weight", (HIDDEN,), quantize=False, base=1.0)
    for i in range(LAYERS):
        add(f"blk.{i}.attn_norm.weight", (HIDDEN,), quantize=False, base=1.0)
        add(f"blk.{i}.ffn_norm.weight", (HIDDEN,), quantize=False, base=1.0)
        add(f"blk.{i}.attn_q_norm.weight", (HEAD_DIM,), quantize=False, base=1.0)
        add(f"blk.{i}.attn_k_norm.weight", (HEAD_DIM,), quantize=False, base=1.0)
        add(f"blk.{i}.attn_q.weight", (HEADS * HEAD_DIM, HIDDEN))
        add(f"blk.{i}.attn_k.weight", (KV_HEADS * HEAD_DIM, HIDDEN))
        add(f"blk.{i}.attn_v.weight", (KV_HEADS * HEAD_DIM, HIDDEN))
        add(f"blk.{i}.attn_output.weight", (HIDDEN, HEADS * HEAD_DIM))
        add(f"blk.{i}.ffn_gate_inp.weight", (MOE_EXPERTS, HIDDEN), quantize=False)
        add(f"blk.{i}.ffn_gate_exps.weight", (MOE_EXPERTS, MOE_INTER, HIDDEN))
        add(f"blk.{i}.ffn_up_exps.weight", (MOE_EXPERTS, MOE_INTER, HIDDEN))
        add(f"blk.{i}.ffn_down_exps.weight", (MOE_EXPERTS, HIDDEN, MOE_INTER))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()

    model_dir = archive_from_path(path, cache_dir=tmp_path / "cache")
    info = json.loads((model_dir / "pagedserve_source_info.json").read_text())
    assert info["gguf"]["architecture"] == "qwen3moe" and info["gguf"]["tensor_types"]["Q8_0"] == 1 + 7 * LAYERS

    # The reference: transformers' Qwen3-MoE holding gguf's de-quantization, experts fused as it keeps them.
    tensors = {t.name: gguf.quants.dequantize(t.data, t.tensor_type) for t in gguf.GGUFReader(str(path)).tensors}
    reference = transformers.Qwen3MoeForCausalLM(config).eval()
    names = {
        "model.embed_tokens.weight": "token_embd",
        "model.norm.weight": "output_norm",
        **{
            f"model.layers.{i}.{hf}": f"blk.{i}.{g}"
            for i in range(LAYERS)
            for hf, g in {
                "input_layernorm.weight": "attn_norm",
                "post_attention_layernorm.weight": "ffn_norm",
                "self_attn.q_norm.weight": "attn_q_norm",
                "self_attn.k_norm.weight": "attn_k_norm",
                "self_attn.q_proj.weight": "attn_q",
                "self_attn.k_proj.weight": "attn_k",
                "self_attn.v_proj.weight": "attn_v",
                "self_attn.o_proj.weight": "attn_output",
                "mlp.gate.weight": "ffn_gate_inp",
                "mlp.experts.down_proj": "ffn_down_exps",
            }.items()
        },
    }
    with torch.no_grad():
        for name, param in reference.named_parameters():
            if name == "lm_head.weight":
                continue
            if name.endswith("mlp.experts.gate_up_proj"):
                i = name.split(".")[2]
                value = np.concatenate(
                    (tensors[f"blk.{i}.ffn_gate_exps.weight"], tensors[f"blk.{i}.ffn_up_exps.weight"]), 1
                )
            else:
                value = tensors[f"{names[name]}.weight"]
            param.copy_(torch.from_numpy(np.ascontiguousarray(value)).reshape(param.shape))
    reference.tie_weights()

    prompt = torch.randint(0, VOCAB, (40,), generator=torch.Generator().manual_seed(3)).tolist()
    with torch.no_grad():
        out = reference.generate(
            torch.tensor([prompt]),
            attention_mask=torch.ones(1, 40, dtype=torch.long),
            max_new_tokens=NEW_TOKENS,
            min_new_tokens=NEW_TOKENS,
            do_sample=False,
        )
        logprobs = torch.log_softmax(reference(out[:, :-1]).logits[0, len(prompt) - 1 :].float(), -1)
    engine = EngineCore(
        EngineConfig(
            model=str(model_dir),
            dtype="float32",
            block_size=4,
            num_kv_blocks=32,
            max_num_batched_tokens=16,
            max_model_len=128,
        )
    )
    engine.add_request(
        Request("q", prompt, SamplingParams(max_tokens=NEW_TOKENS, temperature=0, ignore_eos=True, logprobs=3))
    )
    tokens, steps = [], []
    while engine.has_unfinished_requests():
        for o in engine.step():
            tokens += o.new_token_ids
            steps += o.new_logprobs or []
    assert tokens == out[0, len(prompt) :].tolist() and len(set(tokens)) > 3
    for i, entry in enumerate(steps):
        torch.testing.assert_close(torch.tensor(entry.logprobs), logprobs[i, entry.token_ids], atol=1e-4, rtol=0)
