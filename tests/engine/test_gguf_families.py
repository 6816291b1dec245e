"""GGUF files of another supported architecture than the default model's, in the block types
users bring: a tiny random Qwen3 written as a GGUF (llama.cpp's tensor names, the default model's
GGUF tokenizer) in Q8_0 and Q4_0 (Q4_1: the default model; Q5_0, Q4_K, Q6_K: Gemma 3 270M), archived from its path (pagedserve.engine.model.path_source:
checked, de-quantized to float32) and run through the engine: greedy 32 tokens identical to
transformers loading the same GGUF, and logprobs within 1e-4. (K-quants — Q4_K_M, Q6_K — are
covered by the real Gemma 3 270M file, tests/server/test_gguf_gemma.py.)"""

from __future__ import annotations

import json

import pytest
import torch
import transformers

from pagedserve.engine.config.engine import EngineConfig
from pagedserve.engine.core.engine_core import EngineCore
from pagedserve.engine.request.request import Request
from pagedserve.engine.sampling.params import SamplingParams

gguf = pytest.importorskip("gguf")
pytestmark = pytest.mark.timeout(1800)  # conversion + transformers' own GGUF load, per block type

NEW_TOKENS = 32
# head_dim 128: transformers reads a qwen3 GGUF's head_dim as Qwen3Config's default (128), not
# from `attention.key_length`
HIDDEN, LAYERS, HEADS, KV_HEADS, HEAD_DIM, INTER = 64, 2, 4, 2, 128, 96


def _tokenizer_fields():
    from pagedserve.engine.model.default_model import default_gguf_path

    try:
        path = default_gguf_path()
    except FileNotFoundError as exc:
        pytest.skip(str(exc))
    reader = gguf.GGUFReader(str(path))
    return [(k, f) for k, f in reader.fields.items() if k.startswith("tokenizer.")]


def write_qwen3_gguf(path, hf: transformers.PreTrainedModel, qtype: str) -> None:
    """`hf`'s weights as a llama.cpp-style qwen3 GGUF: 2-D weights in `qtype`, norms in F32."""
    writer = gguf.GGUFWriter(str(path), "qwen3")
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
    for key, field in _tokenizer_fields():
        types = field.types
        value = field.contents()
        writer.add_key_value(key, value, types[0], types[1] if len(types) > 1 else None)
    names = gguf.get_tensor_name_map(gguf.MODEL_ARCH.QWEN3, LAYERS)
    kind = gguf.GGMLQuantizationType[qtype]
    for name, tensor in hf.state_dict().items():
        if name == "lm_head.weight":
            continue  # tied
        gname = names.get_name(name, try_suffixes=(".weight",))
        data = tensor.float().numpy()
        if data.ndim == 2:
            writer.add_tensor(gname, gguf.quants.quantize(data, kind), raw_dtype=kind)
        else:
            writer.add_tensor(gname, data)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()


@pytest.fixture(scope="module")
def hf_qwen3():
    torch.manual_seed(0)
    config = transformers.Qwen3Config(
        vocab_size=49152,
        hidden_size=HIDDEN,
        intermediate_size=INTER,
        num_hidden_layers=LAYERS,
        num_attention_heads=HEADS,
        num_key_value_heads=KV_HEADS,
        head_dim=HEAD_DIM,
        tie_word_embeddings=True,
        initializer_range=0.1,
        rope_theta=1000000.0,
        rms_norm_eps=1e-6,
    )
    model = transformers.Qwen3ForCausalLM(config).eval()
    with torch.no_grad():
        for name, param in model.named_parameters():
            if "norm" in name:
                param.copy_(1 + 0.2 * torch.randn_like(param))
    return model


@pytest.mark.parametrize("qtype", ["Q8_0", "Q4_0"])  # Q4_1: the default model; Q5_0: Gemma 3 270M
def test_qwen3_gguf_matches_transformers(hf_qwen3, qtype, tmp_path, monkeypatch):
    from pagedserve.engine.model.path_source import archive_from_path

    monkeypatch.setenv("PAGEDSERVE_CACHE_DIR", str(tmp_path / "cache"))
    path = tmp_path / f"tiny-qwen3-{qtype}.gguf"
    write_qwen3_gguf(path, hf_qwen3, qtype)
    model_dir = archive_from_path(path)
    info = json.loads((model_dir / "pagedserve_source_info.json").read_text())
    assert info["gguf"] == {"architecture": "qwen3", "tensor_types": {"F32": 4 * LAYERS + 1, qtype: 7 * LAYERS + 1}}

    reference = transformers.AutoModelForCausalLM.from_pretrained(
        str(tmp_path), gguf_file=path.name, dtype=torch.float32
    ).eval()
    prompt = torch.randint(0, 49152, (40,), generator=torch.Generator().manual_seed(3)).tolist()
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
    for i, entry in enumerate(steps):
        torch.testing.assert_close(torch.tensor(entry.logprobs), logprobs[i, entry.token_ids], atol=1e-4, rtol=0)
