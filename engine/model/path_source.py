"""Register a model from the file a user already has: a `.gguf` file or a Hugging Face-style
folder (config.json, tokenizer, safetensors shards) becomes an archive behind the scenes.

The archive is built once per content: its key is the sha256 of the source's files (computed
once per file version and remembered beside the cache, keyed by path, size and mtime), so the
same file registered again — under any name or path — reuses it. A GGUF is checked before any
work (its architecture and every tensor type against what is supported), then de-quantized to
float32 (pagedserve.engine.model.convert) and archived; a folder is archived as it is (its weights keep
their dtype). The archive is a plain folder (`MAR-INF/MANIFEST.json` + the model files) under
`<cache>/from-path/`.
"""

from __future__ import annotations

import fcntl
import hashlib
import json
import re
import shutil
import tempfile
from collections import Counter
from pathlib import Path
from typing import Any

from pagedserve.engine.model.archive_manifest import MANIFEST_PATH, ArchiveFormat

SOURCE_INFO = "pagedserve_source_info.json"  # what the archive was built from, for descriptions


def is_model_path(path: Path) -> bool:
    """A `.gguf` file, or a folder with config.json that is not an archive."""
    if path.is_file():
        return path.suffix.lower() == ".gguf"
    return path.is_dir() and (path / "config.json").is_file() and not (path / MANIFEST_PATH).is_file()


def from_path_cache_dir() -> Path:
    from pagedserve.engine.model.default_model import default_cache_dir

    return default_cache_dir() / "from-path"


def gguf_summary(path: Path) -> dict[str, Any]:
    """{architecture, tensor_types: {type: count}, weights: how many} of a GGUF, read from its
    header and tensor table (nothing de-quantized), checked: ValueError naming an unsupported
    architecture or tensor type and listing what is supported."""
    from pagedserve.engine.model.gguf_header import read_gguf_header

    try:
        header = read_gguf_header(path)
    except (ValueError, OSError) as exc:
        raise ValueError(f"{path.name} is not a readable GGUF file: {exc}") from None
    arch = header.fields.get("general.architecture")
    supported = _registry().supported_gguf_architectures()
    if arch not in supported:
        raise ValueError(f"unsupported GGUF architecture {arch!r}; supported: {', '.join(supported)}")
    types = Counter(t.type_name for t in header.tensors)
    bad = sorted(set(types) - set(_registry().SUPPORTED_GGUF_TYPES))
    if bad:
        raise ValueError(
            f"unsupported GGUF tensor type {', '.join(bad)} in {path.name}; supported: "
            f"{', '.join(_registry().SUPPORTED_GGUF_TYPES)}"
        )
    weights = sum(t.n_elements for t in header.tensors)
    return {"architecture": arch, "tensor_types": dict(sorted(types.items())), "weights": weights}


def check_hf_folder(path: Path) -> dict[str, Any]:
    """The folder's config.json, checked: its architecture (and rope type) must be supported."""
    config = json.loads((path / "config.json").read_text())
    _registry().parse_config(config)  # ValueError names the architecture / rope type and what is supported
    return config


def content_key(path: Path, cache_dir: Path | None = None) -> str:
    """sha256 over the source's files (names and contents); each file's digest is remembered in
    `cache_dir` (default: the from-path cache) keyed by its path, size and mtime, so an unchanged
    file is hashed once."""
    files = (
        [path]
        if path.is_file()
        else sorted(
            p
            for p in path.rglob("*")
            if p.is_file() and not any(part.startswith(".") for part in p.relative_to(path).parts)
        )
    )
    outer = hashlib.sha256()
    for f in files:
        outer.update(f"{f.name if path.is_file() else f.relative_to(path)}\0{_file_digest(f, cache_dir)}\n".encode())
    return outer.hexdigest()


def _file_digest(path: Path, cache_dir: Path | None = None) -> str:
    stat = path.stat()
    memo_dir = (cache_dir or from_path_cache_dir()) / ".digests"
    memo_dir.mkdir(parents=True, exist_ok=True)
    memo = memo_dir / hashlib.sha256(f"{path.resolve()}|{stat.st_size}|{stat.st_mtime_ns}".encode()).hexdigest()
    if memo.is_file():
        return memo.read_text().strip()
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            digest.update(chunk)
    memo.write_text(digest.hexdigest())
    return digest.hexdigest()


def archive_name(path: Path) -> str:
    """A model name from the file or folder name (letters, digits, '_', '-', '.')."""
    stem = path.name[:-5] if path.name.lower().endswith(".gguf") else path.name
    name = re.sub(r"[^A-Za-z0-9_.-]", "-", stem).lstrip("-_.0123456789")
    return name or "model"


def archive_from_path(path: str | Path, cache_dir: Path | None = None, chat_template: str | None = None) -> Path:
    """The archive folder built (once per content) from a `.gguf` file or an HF folder;
    `chat_template` (jinja text) becomes its chat_template.jinja (part of the key).

    Raises ValueError for an unsupported architecture, rope type or GGUF tensor type (before
    anything is converted or copied), FileNotFoundError for a missing path."""
    from pagedserve.engine.model.archive import write_archive

    path = Path(path).expanduser().resolve()
    if not path.exists():
        raise FileNotFoundError(f"model path {path} does not exist")
    if not is_model_path(path):
        raise ValueError(f"{path} is neither a .gguf file nor a model folder with config.json")
    is_gguf = path.is_file()
    info: dict[str, Any] = {"source": str(path), "kind": "gguf" if is_gguf else "hf"}
    if is_gguf:
        info["gguf"] = gguf_summary(path)
        info["weights"] = "de-quantized to float32 at load (GGUF " + ", ".join(info["gguf"]["tensor_types"]) + ")"
    else:
        config = check_hf_folder(path)
        info["weights"] = f"as stored ({config.get('torch_dtype') or config.get('dtype') or 'safetensors'})"
    root = cache_dir or from_path_cache_dir()
    key = content_key(path, root)
    if chat_template is not None:
        key = hashlib.sha256(f"{key}|template|{chat_template}".encode()).hexdigest()
    key = key[:20]
    name = archive_name(path)
    export = root / key
    dest = ArchiveFormat.NO_ARCHIVE.destination(export, name)
    root.mkdir(parents=True, exist_ok=True)
    with open(root / f".{key}.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)  # several registrations of one file build it once
        if (dest / MANIFEST_PATH).is_file():
            return dest
        export.mkdir(parents=True, exist_ok=True)
        work = Path(tempfile.mkdtemp(prefix=".build-", dir=root))
        try:
            model_dir = path
            if is_gguf:
                from pagedserve.engine.model.convert import convert_model

                model_dir = convert_model(path, work / "model")
            extras = [work / SOURCE_INFO]
            extras[0].write_text(json.dumps(info, indent=2) + "\n")
            if chat_template is not None:
                extras.append(work / "chat_template.jinja")
                extras[1].write_text(chat_template)
            write_archive(
                model_dir,
                export,
                model_name=name,
                version="1.0",
                extra_files=extras,
                archive_format=ArchiveFormat.NO_ARCHIVE,
                force=True,
            )
        finally:
            shutil.rmtree(work, ignore_errors=True)
    return dest


def source_info(model_dir: Path) -> dict[str, Any] | None:
    """What an archive built from a path records about its source (None for other archives)."""
    for folder in (model_dir, *model_dir.parents[:1]):
        f = folder / SOURCE_INFO
        if f.is_file():
            return json.loads(f.read_text())
    return None


def describe_model(model_dir: Path) -> dict[str, Any]:
    """What `GET /models/{name}` shows about a model directory: its architecture and family,
    how its weights are held, and every supported architecture."""
    out: dict[str, Any] = {}
    try:
        config = json.loads((model_dir / "config.json").read_text())
        out = {"architecture": _registry().architecture_of(config), "family": _registry().family_of(config).name}
    except (OSError, ValueError):
        pass
    info = source_info(model_dir)
    out["weights"] = info["weights"] if info else "as stored in the archive"
    if info:
        out["source"] = info["kind"]
    out["supportedArchitectures"] = list(_registry().supported_architectures())
    return out


def _registry():
    """The family registry, imported on use: the families import torch, and the front end
    reaches this module (archives by path) without needing them."""
    from pagedserve.engine.model import registry

    return registry
