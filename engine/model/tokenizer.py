"""A model folder's tokenizer, loaded without importing torch where transformers allows it.

`transformers.AutoTokenizer` reads the model's config through `AutoConfig` to pick the tokenizer
class, and importing either imports torch: ~4 s of CPU in a server's front end, which otherwise
never needs torch, for every server start and every model registered. Most folders name a
generic class in `tokenizer_config.json` (`PreTrainedTokenizerFast`, as transformers writes it
when it converts a GGUF, or `TokenizersBackend`), and for most model types `AutoTokenizer` then
builds exactly that class from `tokenizer.json`. Those folders are loaded with the class
directly (~0.3 s, no torch). Every other folder, and every model type for which `AutoTokenizer`
overrides a generic class (qwen2, which it gives its Qwen2 tokenizer; the types in transformers'
`MODELS_WITH_INCORRECT_HUB_TOKENIZER_CLASS`, phi3 among them; the Mistral types, which may
take its Mistral backend), goes through `AutoTokenizer` as before. tests/engine/model/test_tokenizer.py checks for each type below
that `AutoTokenizer` builds the same tokenizer.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

GENERIC_CLASSES = frozenset({"PreTrainedTokenizerFast", "TokenizersBackend"})
# Model types (config.json's `model_type`) whose generic tokenizer class AutoTokenizer keeps.
DIRECT_MODEL_TYPES = frozenset({"llama", "qwen3", "qwen2_moe", "qwen3_moe", "gemma2", "gemma3", "gemma3_text", "olmoe"})


def load_tokenizer(model_dir: str | Path) -> Any:
    """The tokenizer of the model folder `model_dir` (local files only)."""
    model_dir = Path(model_dir)
    if loads_directly(model_dir):
        from transformers import PreTrainedTokenizerFast

        return PreTrainedTokenizerFast.from_pretrained(str(model_dir), local_files_only=True)
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(model_dir), local_files_only=True)


def loads_directly(model_dir: Path) -> bool:
    """Whether `load_tokenizer` builds the folder's generic tokenizer class itself."""
    try:
        tokenizer_config = json.loads((model_dir / "tokenizer_config.json").read_text())
        model_type = json.loads((model_dir / "config.json").read_text()).get("model_type")
    except (OSError, ValueError, AttributeError):
        return False
    return (
        isinstance(tokenizer_config, dict)
        and tokenizer_config.get("tokenizer_class") in GENERIC_CLASSES
        and "auto_map" not in tokenizer_config
        and model_type in DIRECT_MODEL_TYPES
        and (model_dir / "tokenizer.json").is_file()
    )
