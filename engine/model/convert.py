"""Convert a GGUF file or a Hugging Face model directory into a plain model directory.

The result holds `config.json`, one float32 `model.safetensors` (Hugging Face tensor names),
the tokenizer files with the chat template, `generation_config.json`, and
`pagedserve_source.json` recording what it was made from. It is built in a temporary sibling
directory and renamed into place at the end, so an interrupted conversion leaves nothing behind.
"""

from __future__ import annotations

import functools
import hashlib
import json
import os
import shutil
import struct
import sys
import tempfile
from collections.abc import Callable, Iterable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

FORMAT_VERSION = 1  # bump when the output layout changes (it is part of cache keys)
SOURCE_RECORD = "pagedserve_source.json"
WEIGHTS_FILE = "model.safetensors"

# Copied verbatim from a Hugging Face directory when present.
TOKENIZER_FILES = (
    "tokenizer.json",
    "tokenizer_config.json",
    "special_tokens_map.json",
    "added_tokens.json",
    "tokenizer.model",
    "vocab.json",
    "merges.txt",
    "vocab.txt",
    "chat_template.jinja",
    "chat_template.json",
    "generation_config.json",
)
_ST_DTYPES = {
    "F64": "float64",
    "F32": "float32",
    "F16": "float16",
    "BF16": "bfloat16",
    "I64": "int64",
    "I32": "int32",
    "I16": "int16",
    "I8": "int8",
    "U8": "uint8",
    "BOOL": "bool",
}

# (name, shape, torch dtype, loader returning the tensor)
TensorSpec = tuple[str, tuple[int, ...], Any, Callable[[], Any]]


def held(value: Any) -> Callable[[], Any]:
    """A TensorSpec's loader for a tensor already in memory."""
    return lambda: value


def convert_model(source: str | Path, dest: str | Path, *, overwrite: bool = False) -> Path:
    """Convert `source` (a .gguf file or a Hugging Face model folder) into `dest`; return dest."""
    source = Path(source).expanduser().resolve()
    dest = Path(dest).expanduser().absolute()
    if not source.exists():
        raise FileNotFoundError(f"model source {source} does not exist")
    is_gguf = source.is_file() and source.suffix.lower() == ".gguf"
    if not is_gguf and not (source / "config.json").is_file():
        raise ValueError(
            f"{source} is neither a .gguf file nor a Hugging Face model directory "
            "(a folder with config.json and weights)"
        )
    if dest.resolve() == source or source in dest.resolve().parents:
        raise ValueError(f"destination {dest} must not be the source or lie inside it")
    if dest.exists() and not overwrite:
        raise FileExistsError(f"{dest} already exists; pass overwrite=True to replace it")
    dest.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{dest.name}.tmp-", dir=dest.parent))
    try:
        tmp.chmod(0o755)  # mkdtemp makes it private; the result is an ordinary folder
        read = _convert_gguf(source, tmp) if is_gguf else _convert_hf_dir(source, tmp)
        _write_source_record(tmp / SOURCE_RECORD, source, read, "gguf" if is_gguf else "hf")
        _move_into_place(tmp, dest)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return dest


def _convert_gguf(path: Path, out: Path) -> list[Path]:
    """De-quantise a GGUF through transformers; write weights, config and tokenizer to `out`.
    The file is parsed once (pagedserve.engine.model.gguf_once)."""
    from pagedserve.engine.model.gguf_once import gguf_read_once

    with gguf_read_once():
        return _convert_gguf_read_once(path, out)


def _convert_gguf_read_once(path: Path, out: Path) -> list[Path]:
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(path.parent, gguf_file=path.name)
    tokenizer.save_pretrained(out)
    # A model loaded from GGUF is marked quantized and save_pretrained refuses it, so its
    # (already de-quantised, float32) state dict is streamed to safetensors directly.
    # (model, loading info): transformers' annotation names the model alone
    loaded: Any = AutoModelForCausalLM.from_pretrained(
        path.parent, gguf_file=path.name, dtype=torch.float32, output_loading_info=True
    )
    model, loading = loaded
    # transformers re-initializes (randomly) what does not fit the config it read from the GGUF:
    # a conversion must never hand such weights on.
    bad = {k: sorted(loading.get(k) or ())[:5] for k in ("missing_keys", "mismatched_keys")}
    if any(bad.values()):
        raise ValueError(
            f"{path.name}: the weights do not fit the shape read from its metadata "
            f"(missing: {bad['missing_keys']}, mismatched: {bad['mismatched_keys']})"
        )
    config = model.config
    if hasattr(config, "quantization_config"):
        del config.quantization_config
    config.dtype = torch.float32
    for key, value in config.to_diff_dict().items():
        if isinstance(value, float):
            setattr(config, key, _shortest_float32(value))
    config.save_pretrained(out)
    _tidy_tokenizer_config(out / "tokenizer_config.json", config.max_position_embeddings)
    specs: list[TensorSpec] = [
        (n, tuple(t.shape), t.dtype, held(t)) for n, t in _per_expert(_drop_shared(model.state_dict().items()))
    ]
    _write_safetensors(out / WEIGHTS_FILE, specs)
    _write_generation_config(out)
    return [path]


def _per_expert(items: Iterable[tuple[str, Any]]) -> list[tuple[str, Any]]:
    """transformers holds a MoE block's experts as 3-D tensors (`mlp.experts.gate_up_proj`
    `[E, 2I, H]`, gate rows first, and `mlp.experts.down_proj` `[E, H, I]`); the checkpoint
    names every expert's projections (`mlp.experts.{e}.gate_proj.weight`, ...), as its
    save_pretrained does."""
    out = []
    for name, tensor in items:
        prefix, _, leaf = name.rpartition(".")
        if not prefix.endswith("mlp.experts") or tensor.dim() != 3 or leaf not in ("gate_up_proj", "down_proj"):
            out.append((name, tensor))
            continue
        for e, weight in enumerate(tensor):
            if leaf == "down_proj":
                out.append((f"{prefix}.{e}.down_proj.weight", weight.contiguous()))
            else:
                half = weight.shape[0] // 2
                out.append((f"{prefix}.{e}.gate_proj.weight", weight[:half].contiguous()))
                out.append((f"{prefix}.{e}.up_proj.weight", weight[half:].contiguous()))
    return out


def _convert_hf_dir(src: Path, out: Path) -> list[Path]:
    """Copy config and tokenizer files; rewrite the weights as one float32 safetensors file."""
    config = json.loads((src / "config.json").read_text())
    if config.get("quantization_config"):
        method = config["quantization_config"].get("quant_method", "?")
        raise ValueError(f"{src} holds a quantized model ({method}); convert an unquantized checkpoint instead")
    weight_files = _find_weight_files(src)
    copied = [src / n for n in TOKENIZER_FILES if (src / n).is_file()]
    if not any(p.name in ("tokenizer.json", "tokenizer.model", "vocab.json") for p in copied):
        raise ValueError(f"{src} has no tokenizer (tokenizer.json, tokenizer.model or vocab.json)")
    for path in copied:
        shutil.copy2(path, out / path.name)
    if (src / "additional_chat_templates").is_dir():
        shutil.copytree(src / "additional_chat_templates", out / "additional_chat_templates")
    config["dtype"] = "float32"  # transformers 5 reads `dtype`, 4.x `torch_dtype`
    if "torch_dtype" in config:
        config["torch_dtype"] = "float32"
    (out / "config.json").write_text(json.dumps(config, indent=2, sort_keys=True) + "\n")
    with _open_weights(weight_files) as specs:
        _write_safetensors(out / WEIGHTS_FILE, specs)
    if not (out / "generation_config.json").exists():
        _write_generation_config(out)
    return [src / "config.json", *weight_files, *copied]


def _find_weight_files(src: Path) -> list[Path]:
    for index, single in (
        ("model.safetensors.index.json", "model.safetensors"),
        ("pytorch_model.bin.index.json", "pytorch_model.bin"),
    ):
        if (src / index).is_file():
            names = sorted(set(json.loads((src / index).read_text())["weight_map"].values()))
            return [src / n for n in names]
        if (src / single).is_file():
            return [src / single]
    raise FileNotFoundError(
        f"{src} has no weights: expected model.safetensors, pytorch_model.bin or a sharded index of either"
    )


@contextmanager
def _open_weights(files: list[Path]) -> Iterator[list[TensorSpec]]:
    """Yield TensorSpecs over safetensors (memory-mapped) or pytorch .bin files."""
    import torch
    from safetensors import safe_open

    specs: list[TensorSpec] = []
    tensors: list[tuple[str, Any]] = []
    for path in files:
        if path.suffix == ".safetensors":
            handle = safe_open(str(path), framework="pt")
            for name in handle.keys():
                part = handle.get_slice(name)
                dtype = getattr(torch, _ST_DTYPES[part.get_dtype()])
                specs.append((name, tuple(part.get_shape()), dtype, functools.partial(handle.get_tensor, name)))
        else:  # the one place pickle is read: tensors only, memory-mapped when possible
            try:
                state = torch.load(path, map_location="cpu", weights_only=True, mmap=True)
            except RuntimeError:  # the legacy (non-zip) format cannot be memory-mapped
                state = torch.load(path, map_location="cpu", weights_only=True)
            if not all(isinstance(v, torch.Tensor) for v in state.values()):
                raise ValueError(f"{path} is not a plain state dict of tensors")
            tensors.extend(state.items())
    specs.extend((n, tuple(t.shape), t.dtype, held(t)) for n, t in _drop_shared(tensors))
    try:
        yield specs
    finally:
        specs.clear()  # drop the file handles and memory maps


def _drop_shared(items: Iterable[tuple[str, Any]]) -> list[tuple[str, Any]]:
    """Keep the first name of tensors that are the same memory (tied embeddings)."""
    seen: set[tuple[int, tuple[int, ...], tuple[int, ...]]] = set()
    kept = []
    for name, tensor in items:
        key = (tensor.data_ptr(), tuple(tensor.shape), tuple(tensor.stride()))
        if tensor.numel() and key in seen:
            continue
        seen.add(key)
        kept.append((name, tensor))
    return kept


def _write_safetensors(path: Path, specs: list[TensorSpec]) -> None:
    """Write tensors one at a time (floating point as float32) so no second copy is held."""
    import torch

    if sys.byteorder != "little":
        raise RuntimeError("safetensors output needs a little-endian machine")
    names = {
        torch.float32: "F32",
        torch.int64: "I64",
        torch.int32: "I32",
        torch.int16: "I16",
        torch.int8: "I8",
        torch.uint8: "U8",
        torch.bool: "BOOL",
    }
    header: dict[str, Any] = {"__metadata__": {"format": "pt"}}
    offset = 0
    for name, shape, dtype, _ in specs:
        out_dtype = torch.float32 if dtype.is_floating_point else dtype
        if out_dtype not in names:
            raise ValueError(f"tensor {name} has unsupported dtype {dtype}")
        size = out_dtype.itemsize * int(torch.Size(shape).numel())
        header[name] = {"dtype": names[out_dtype], "shape": list(shape), "data_offsets": [offset, offset + size]}
        offset += size
    raw = json.dumps(header, separators=(",", ":")).encode()
    raw += b" " * (-len(raw) % 8)  # keep the data section 8-byte aligned
    with open(path, "wb") as f:
        f.write(struct.pack("<Q", len(raw)))
        f.write(raw)
        for name, shape, _, load in specs:
            tensor = load()
            if tuple(tensor.shape) != shape:
                raise ValueError(f"tensor {name} changed shape while reading")
            if tensor.is_floating_point():
                tensor = tensor.to(torch.float32)
            f.write(memoryview(tensor.detach().contiguous().reshape(-1).view(torch.uint8).numpy()))
        f.flush()
        os.fsync(f.fileno())


def _write_generation_config(out: Path) -> None:
    from transformers import AutoConfig, GenerationConfig

    GenerationConfig.from_model_config(AutoConfig.from_pretrained(out)).save_pretrained(out)


def _tidy_tokenizer_config(path: Path, max_length: int) -> None:
    """Fix what a GGUF tokenizer saves: load-time keys, no length limit, a 5.x-only class."""
    data = json.loads(path.read_text())
    for key in ("is_local", "local_files_only"):
        data.pop(key, None)
    if data.get("model_max_length", 1e30) >= 1e29:  # transformers' "no limit" sentinel
        data["model_max_length"] = max_length
    if data.get("tokenizer_class") == "TokenizersBackend":
        data["tokenizer_class"] = "PreTrainedTokenizerFast"  # same class in 5.x, known in 4.x
    path.write_text(json.dumps(data, indent=2, sort_keys=True, ensure_ascii=False) + "\n")


def _shortest_float32(value: float) -> float:
    """GGUF stores float32: write 1e-05, not 9.999999747378752e-06 (same float32 value)."""
    import numpy as np

    as32 = np.float32(value)
    return float(str(as32)) if float(as32) == value else value


def _sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            digest.update(chunk)
    return digest.hexdigest()


def _write_source_record(path: Path, source: Path, files: list[Path], kind: str) -> None:
    base = source.parent if source.is_file() else source
    record = {
        "format_version": FORMAT_VERSION,
        "kind": kind,
        "source": str(source),
        "files": [{"name": str(p.relative_to(base)), "size": p.stat().st_size, "sha256": _sha256(p)} for p in files],
    }
    path.write_text(json.dumps(record, indent=2) + "\n")


def _move_into_place(tmp: Path, dest: Path) -> None:
    """Rename `tmp` to `dest`; an existing `dest` is moved aside first and removed after."""
    if not os.path.lexists(dest):
        os.rename(tmp, dest)
        return
    old = Path(tempfile.mkdtemp(prefix=f".{dest.name}.old-", dir=dest.parent))
    aside = old / "previous"
    os.rename(dest, aside)
    try:
        os.rename(tmp, dest)
    except BaseException:
        os.rename(aside, dest)
        raise
    finally:
        shutil.rmtree(old, ignore_errors=True)
