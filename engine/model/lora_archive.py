"""LoRA adapter archives: a PEFT folder packaged like a model, bound to its base model's weights.

The manifest's `model.lora` record names the base model and pins its weights:

    "lora": {"baseModel": "smollm2", "baseVersion": "1.0" | null,
             "baseWeightsSha256": "<hex>", "rank": 8, "targetModules": [...]}

`baseWeightsSha256` is `weights_digest` of the base archive's weight files (the sha256 of each
`*.safetensors` file and index, as its manifest lists them), so a server can refuse to attach the
adapter to a base whose weights differ, without reading gigabytes again.
"""

from __future__ import annotations

import hashlib
import json
import re
import tarfile
import zipfile
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from pagedserve.engine.lora.adapter import CONFIG_FILE, WEIGHTS_FILE, read_adapter_config
from pagedserve.engine.model.archive_manifest import MANIFEST_PATH, ArchiveError, ArchiveFormat

_SHA256 = re.compile(r"^[0-9a-f]{64}$")


def _is_weights(name: str) -> bool:
    return name.endswith(".safetensors") or name.endswith(".safetensors.index.json")


def weights_digest(files: Mapping[str, str]) -> str:
    """One sha256 over a model's weight files, given each file's sha256 (relative path -> hex)."""
    lines = "".join(f"{name}\t{files[name]}\n" for name in sorted(files) if _is_weights(name))
    if not lines:
        raise ValueError("the model has no *.safetensors weights to pin an adapter to")
    return hashlib.sha256(lines.encode()).hexdigest()


def model_dir_digest(model_dir: Path, manifest: Mapping[str, Any] | None = None) -> str:
    """`weights_digest` of a model directory: from its manifest's `files` map when it has one
    (already verified when the archive was opened), else by hashing the files."""
    files = (manifest or {}).get("files")
    if not isinstance(files, dict):
        files = {
            p.relative_to(model_dir).as_posix(): _file_sha256(p)
            for p in sorted(model_dir.rglob("*"))
            if p.is_file() and _is_weights(p.name)
        }
    return weights_digest(files)


def _file_sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(1 << 20):
            digest.update(chunk)
    return digest.hexdigest()


def read_manifest(path: Path) -> dict[str, Any] | None:
    """The manifest of an archive (.mar, .tar.gz or folder) without extracting it; None if it
    has none (or is not an archive)."""
    try:
        if path.is_dir():
            target = path / MANIFEST_PATH
            return json.loads(target.read_text()) if target.is_file() else None
        if path.name.endswith(".mar"):
            with zipfile.ZipFile(path) as zf:
                return json.loads(zf.read(MANIFEST_PATH))
        if path.name.endswith(".tar.gz"):
            with tarfile.open(path, "r:gz") as tf:
                for member in tf:
                    if member.name.endswith(MANIFEST_PATH) and (file := tf.extractfile(member)) is not None:
                        return json.loads(file.read())
    except (OSError, KeyError, ValueError, zipfile.BadZipFile, tarfile.TarError):
        return None
    return None


def find_base_manifest(store: Path, name: str, version: str | None) -> dict[str, Any]:
    """The manifest of the archive in `store` holding model `name` (at `version`, or the highest
    version found); ValueError naming what was looked for."""
    found: list[dict[str, Any]] = []
    for path in sorted(store.iterdir()) if store.is_dir() else []:
        manifest = read_manifest(path) or {}
        model = manifest.get("model") or {}
        if model.get("modelName") == name and "lora" not in model:
            if version is None or str(model.get("modelVersion")) == version:
                found.append(manifest)
    if not found:
        at = f" version {version}" if version else ""
        raise ValueError(f"no archive of base model {name!r}{at} in {store}")
    return max(found, key=lambda m: str(m["model"].get("modelVersion")))


def lora_record(adapter_dir: Path, base_manifest: Mapping[str, Any], base_version: str | None) -> dict[str, Any]:
    """The manifest's `model.lora` record for an adapter bound to this base archive."""
    config = read_adapter_config(adapter_dir)
    files = base_manifest.get("files")
    if not isinstance(files, dict):
        raise ValueError("the base archive's manifest lists no file hashes: re-archive it with pagedserve")
    targets = config.get("target_modules")
    return {
        "baseModel": base_manifest["model"]["modelName"],
        "baseVersion": base_version,
        "baseWeightsSha256": weights_digest(files),
        "rank": config["r"],
        "targetModules": sorted(targets) if isinstance(targets, list) else targets,
    }


def check_lora_record(record: Any, content: Mapping[str, str]) -> None:
    """An adapter archive's `model.lora` record and files; ArchiveError naming the fault."""
    if not isinstance(record, dict) or not isinstance(record.get("baseModel"), str) or not record["baseModel"]:
        raise ArchiveError(f"malformed {MANIFEST_PATH}: model.lora.baseModel must name the base model")
    if not isinstance(record.get("baseWeightsSha256"), str) or not _SHA256.match(record["baseWeightsSha256"]):
        raise ArchiveError(f"malformed {MANIFEST_PATH}: model.lora.baseWeightsSha256 must be a sha256 hex digest")
    version = record.get("baseVersion")
    if version is not None and not isinstance(version, str):
        raise ArchiveError(f"malformed {MANIFEST_PATH}: model.lora.baseVersion must be a string or null")
    missing = [name for name in (CONFIG_FILE, WEIGHTS_FILE) if name not in content]
    if missing:
        raise ArchiveError(f"the adapter archive lacks {', '.join(missing)}")


def write_lora_archive(
    adapter_dir: str | Path,
    export_path: str | Path,
    *,
    model_name: str,
    version: str,
    base_model: str,
    base_version: str | None,
    model_store: str | Path,
    archive_format: ArchiveFormat | str = ArchiveFormat.DEFAULT,
    force: bool = False,
) -> Path:
    """Package a PEFT adapter folder bound to base model `base_model[:base_version]`, whose
    archive is looked up in `model_store` for its weights' hash; returns the archive's path."""
    from pagedserve.engine.model.archive_write import write_archive

    adapter_dir = Path(adapter_dir)
    base = find_base_manifest(Path(model_store), base_model, base_version)
    record = lora_record(adapter_dir, base, base_version)
    return write_archive(
        adapter_dir,
        export_path,
        model_name=model_name,
        version=version,
        archive_format=archive_format,
        force=force,
        lora=record,
    )
