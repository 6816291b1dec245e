"""The model archive's manifest (`MAR-INF/MANIFEST.json`): schema, checks and handler resolution.

The manifest follows TorchServe's schema::

    {"createdOn": "31/12/2025 23:59:59", "runtime": "python", "archiverVersion": "...",
     "model": {"modelName": ..., "modelVersion": ..., "handler": ...,
               "serializedFile"?: ..., "configFile"?: ..., "extensions"?: ...},
     "files": {"config.json": "<sha256 hex>", ...}}

`files` is pagedserve's extension: the sha256 of every file in the archive except the manifest,
keyed by its path relative to the archive root ('/' separated). Archives made by TorchServe's
`torch-model-archiver` have no `files` map; they open without hash checks.
"""

from __future__ import annotations

import enum
import re
from collections.abc import Mapping
from pathlib import Path
from typing import Any

MANIFEST_DIR = "MAR-INF"
MANIFEST_PATH = f"{MANIFEST_DIR}/MANIFEST.json"
ARCHIVER_VERSION = "pagedserve-archive-1"
CREATED_ON_FORMAT = "%d/%m/%Y %H:%M:%S"
BUILTIN_HANDLER = "llm"
# Names of the built-in handler: ours, and TorchServe's vLLM handler (its archives ship no code;
# their model-config is read by pagedserve.engine.model.vllm_config).
BUILTIN_HANDLERS = (BUILTIN_HANDLER, "vllm_handler")
CUSTOM_HANDLER_HINT = (
    "it runs only if the operator allows custom handlers explicitly (open_archive(..., allow_custom_handlers=True))"
)
# Weights that unpickle (and so can run arbitrary code) when loaded.
PICKLE_SUFFIXES = (".bin", ".pt", ".pth", ".ckpt", ".pkl", ".pickle")
CONVERT_HINT = (
    "pagedserve loads safetensors only (pickle can run arbitrary code): convert the "
    "model with pagedserve.engine.model.convert.convert_model(source_dir, dest_dir) and archive "
    "the converted directory"
)
# TorchServe's rule for model names (they become URL path segments and file names).
MODEL_NAME_RE = re.compile(r"^[A-Za-z][A-Za-z0-9_\-.]*$")
_SHA256_RE = re.compile(r"^[0-9a-f]{64}$")


class ArchiveError(ValueError):
    """An archive that is malformed or unsafe to open; the message says why."""


class ArchiveFormat(str, enum.Enum):
    """How `write_archive` packages a model: a zip `.mar`, a `.tar.gz`, or a plain folder."""

    DEFAULT = "default"
    TGZ = "tgz"
    NO_ARCHIVE = "no-archive"

    def destination(self, export_path: Path, model_name: str) -> Path:
        suffix = {ArchiveFormat.DEFAULT: ".mar", ArchiveFormat.TGZ: ".tar.gz"}.get(self, "")
        return export_path / f"{model_name}{suffix}"


def is_pickle_weights(rel_path: str) -> bool:
    return rel_path.lower().endswith(PICKLE_SUFFIXES)


def check_model_name(name: Any) -> str:
    if not isinstance(name, str) or not MODEL_NAME_RE.match(name):
        raise ArchiveError(
            f"invalid model name {name!r}: it must start with a letter and hold only letters, digits, '_', '-' and '.'"
        )
    return name


def validate_manifest(manifest: Any) -> dict[str, Any]:
    """Check the manifest's shape; return it. ArchiveError names the first bad field."""
    if not isinstance(manifest, dict):
        raise ArchiveError(f"malformed {MANIFEST_PATH}: expected a JSON object")
    model = manifest.get("model")
    if not isinstance(model, dict):
        raise ArchiveError(f"malformed {MANIFEST_PATH}: missing the 'model' object")
    check_model_name(model.get("modelName"))
    handler = model.get("handler")
    if not isinstance(handler, str) or not handler.strip():
        raise ArchiveError(f"malformed {MANIFEST_PATH}: missing model.handler")
    for key in ("modelVersion", "serializedFile", "configFile"):
        if key in model and not (isinstance(model[key], str) and model[key]):
            raise ArchiveError(f"malformed {MANIFEST_PATH}: model.{key} must be a non-empty string")
    runtime = manifest.get("runtime", "python")
    if runtime not in ("python", "python3"):
        raise ArchiveError(
            f"unsupported runtime {runtime!r} in {MANIFEST_PATH}; pagedserve runs 'python' archives only"
        )
    if "files" in manifest:
        files = manifest["files"]
        if not isinstance(files, dict) or not all(
            isinstance(k, str) and isinstance(v, str) and _SHA256_RE.match(v) for k, v in files.items()
        ):
            raise ArchiveError(f"malformed {MANIFEST_PATH}: 'files' must map paths to sha256 hex digests")
    return manifest


def resolve_handler(handler: str, files: Mapping[str, Path], allow_custom: bool) -> Path | None:
    """The custom handler file to load, or None for the built-in `llm` handler.

    `files` maps archive-relative paths to their paths on disk. A handler is custom when it
    names a Python file shipped in the archive (`my_handler`, `my_handler.py`,
    `my_handler:fn`); that is arbitrary code, refused unless `allow_custom`.
    torch-model-archiver cannot package `--handler llm` without an `llm.py` next to it, so an
    `llm.py` holding no code (blank lines and comments only) stands for the built-in handler.
    TorchServe's `vllm_handler` (built into TorchServe, shipped as no file) is served by it too.
    """
    module, _, func = handler.partition(":")
    if "/" in module or "\\" in module:
        raise ArchiveError(f"handler {handler!r} must name a file at the archive root, not a path")
    filename = module if module.endswith(".py") else f"{module}.py"
    shipped = files.get(filename)
    if module in BUILTIN_HANDLERS and not func and (shipped is None or not _has_code(shipped)):
        return None
    if shipped is not None:
        if not allow_custom:
            raise ArchiveError(
                f"handler {handler!r} is Python code shipped inside the archive ({filename}); {CUSTOM_HANDLER_HINT}"
            )
        return shipped
    if module.endswith(".py") or func:
        raise ArchiveError(f"handler {handler!r} names {filename}, which is not in the archive")
    raise ArchiveError(
        f"unknown handler {handler!r}; the built-in handler is {BUILTIN_HANDLER!r}, "
        "or ship a handler .py file in the archive"
    )


def _has_code(path: Path) -> bool:
    if path.stat().st_size > 1 << 16:  # no placeholder is that long
        return True
    text = path.read_bytes()
    return any(line.strip() and not line.strip().startswith(b"#") for line in text.splitlines())
