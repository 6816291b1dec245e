"""Loading a model folder's tokenizer (pagedserve.engine.model.tokenizer): folders that name a
generic tokenizer class are built with that class directly, without importing torch, and the
result is the tokenizer `AutoTokenizer` builds for every model type that path takes; the model
types for which AutoTokenizer would choose another class go through AutoTokenizer."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from pagedserve.engine.model.tokenizer import DIRECT_MODEL_TYPES, load_tokenizer, loads_directly

TEXTS = ["Hello, world!", "1, 2, 3, 4,", "  spaces\tand\nnew lines  ", "naïve café 東京 🙂"]
MESSAGES = [{"role": "user", "content": "What is 2 plus 2?"}]


def _folder(
    root: Path, default_model_dir: Path, model_type: str, tokenizer_class: str = "PreTrainedTokenizerFast"
) -> Path:
    folder = root / f"{model_type}-{tokenizer_class}"
    folder.mkdir()
    for name in ("tokenizer.json", "chat_template.jinja"):
        shutil.copy(default_model_dir / name, folder / name)
    tokenizer_config = json.loads((default_model_dir / "tokenizer_config.json").read_text())
    tokenizer_config["tokenizer_class"] = tokenizer_class
    (folder / "tokenizer_config.json").write_text(json.dumps(tokenizer_config))
    (folder / "config.json").write_text(json.dumps({"model_type": model_type}))
    return folder


@pytest.mark.parametrize("model_type", sorted(DIRECT_MODEL_TYPES))
def test_the_direct_path_builds_what_auto_tokenizer_builds(default_model_dir, tmp_path, model_type):
    from transformers import AutoTokenizer

    folder = _folder(tmp_path, default_model_dir, model_type)
    assert loads_directly(folder)
    direct, auto = load_tokenizer(folder), AutoTokenizer.from_pretrained(str(folder), local_files_only=True)
    assert type(direct) is type(auto)
    for text in TEXTS:
        assert direct.encode(text) == auto.encode(text)
        assert direct.encode(text, add_special_tokens=False) == auto.encode(text, add_special_tokens=False)
    assert direct.all_special_ids == auto.all_special_ids
    assert (direct.bos_token_id, direct.eos_token_id, direct.pad_token_id) == (
        auto.bos_token_id,
        auto.eos_token_id,
        auto.pad_token_id,
    )
    chat = dict(tokenize=False, add_generation_prompt=True)
    assert direct.apply_chat_template(MESSAGES, **chat) == auto.apply_chat_template(MESSAGES, **chat)


@pytest.mark.parametrize(
    "model_type, tokenizer_class",
    [
        ("qwen2", "PreTrainedTokenizerFast"),
        ("phi3", "PreTrainedTokenizerFast"),
        ("mistral", "PreTrainedTokenizerFast"),
        ("llama", "LlamaTokenizer"),
    ],
)
def test_other_folders_go_through_auto_tokenizer(default_model_dir, tmp_path, model_type, tokenizer_class):
    """AutoTokenizer overrides the declared class for qwen2 (its Qwen2 tokenizer) and phi3 (one of
    transformers' types with a known wrong class), mistral may take its Mistral backend, and a
    named class is AutoTokenizer's to resolve."""
    from transformers import AutoTokenizer

    folder = _folder(tmp_path, default_model_dir, model_type, tokenizer_class)
    assert not loads_directly(folder)
    assert type(load_tokenizer(folder)) is type(AutoTokenizer.from_pretrained(str(folder), local_files_only=True))


def test_a_folder_without_its_config_files_is_not_loaded_directly(tmp_path):
    assert not loads_directly(tmp_path)
    (tmp_path / "tokenizer_config.json").write_text("[1, 2]")
    (tmp_path / "config.json").write_text("{}")
    assert not loads_directly(tmp_path)


def test_the_default_model_tokenizer_loads_without_torch(default_model_dir):
    code = (
        "import sys\n"
        "from pagedserve.engine.model.tokenizer import load_tokenizer\n"
        f"tok = load_tokenizer({str(default_model_dir)!r})\n"
        "assert tok.encode('1, 2, 3')\n"
        "print('torch' in sys.modules)\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True, timeout=120)
    assert out.stdout.strip() == "False"
