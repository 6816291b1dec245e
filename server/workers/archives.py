"""Where a registration's archive comes from: URL checks against `allowed_urls`, then opening it.

Besides archives, a URL may name a `.gguf` file or a Hugging Face-style model folder, under the
same location rules: it becomes an archive behind the scenes, built once per content
(pagedserve.engine.model.path_source).

A URL is a path (relative ones resolve inside the model store) or a `file://` URL. By default
only files inside the model store are allowed; `allowed_urls` replaces that rule with regular
expressions the URL must match in full. Nothing is ever downloaded: an `http(s)://` URL is
refused whether or not it matches.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml

from pagedserve.engine.model.archive_manifest import MANIFEST_PATH, check_model_name, resolve_handler
from pagedserve.engine.model.model_config import ModelConfig, load_model_config
from pagedserve.engine.model.model_source import is_archive, resolve_model_dir
from pagedserve.engine.model.path_source import archive_from_path, is_model_path
from pagedserve.handlers.base_handler import BaseHandler
from pagedserve.handlers.custom_handler import load_custom_handler


class UrlNotAllowedError(PermissionError):
    """The URL is outside `allowed_urls` (403); nothing was read."""


class ArchiveNotFoundError(FileNotFoundError):
    """No archive at that URL (404)."""


def store_archives(store: Path) -> list[Path]:
    """The archives in the model store (archive files, extracted archive folders), sorted by
    name: what `--models all` registers and the console offers to register."""
    return [p for p in sorted(store.iterdir()) if is_archive(p)] if store.is_dir() else []


def resolve_url(url: str, model_store: Path, allowed_urls: list[str]) -> Path:
    """The local archive path a registration URL names, if the URL is allowed."""
    if not isinstance(url, str) or not url.strip():
        raise ValueError("the 'url' parameter is required: an archive in the model store")
    url = url.strip()
    if any(ord(c) < 0x20 or ord(c) == 0x7F for c in url):  # a NUL byte, a newline: not a path
        raise ValueError(f"url {url[:80]!r} holds a control character: it cannot name an archive")
    scheme = re.match(r"^([A-Za-z][A-Za-z0-9+.-]*)://", url)
    if scheme and scheme.group(1).lower() != "file":
        if allowed_urls and any(re.fullmatch(p, url) for p in allowed_urls):
            raise ValueError(
                f"url {url!r}: pagedserve does not download archives; copy the "
                "archive into the model store and register it by name"
            )
        raise UrlNotAllowedError(
            f"url {url!r} is not allowed: only archives inside the model "
            "store (or matching allowed_urls) can be registered"
        )
    raw = url[len("file://") :] if scheme else url
    path = Path(raw).expanduser()
    if not path.is_absolute():
        path = model_store / path
    resolved = path.resolve()  # follows links and '..': the check sees the real location
    if allowed_urls:
        # Only the resolved location is matched: "allowed/../elsewhere" cannot slip through.
        candidates = (str(resolved), f"file://{resolved}")
        if not any(re.fullmatch(p, c) for p in allowed_urls for c in candidates):
            raise UrlNotAllowedError(f"url {url!r} does not match allowed_urls")
    elif not resolved.is_relative_to(model_store.resolve()) or resolved == model_store.resolve():
        raise UrlNotAllowedError(
            f"url {url!r} is outside the model store {model_store}; only archives inside it can be registered"
        )
    if not resolved.exists():
        raise ArchiveNotFoundError(f"Model not found in model store: {url}")
    if not is_archive(resolved) and not is_model_path(resolved):
        raise ValueError(
            f"url {url!r} is not a model archive (.mar, .tar.gz, or a folder with "
            f"{MANIFEST_PATH}), a .gguf file or a model folder with config.json"
        )
    return resolved


@dataclass(slots=True)
class LoadedArchive:
    """An opened, verified archive and what the server needs from it."""

    path: Path  # the archive as registered
    model_dir: Path  # its verified model directory (extracted once into the cache)
    manifest: dict[str, Any]
    model_config: ModelConfig
    config_keys: frozenset[str] = field(default_factory=frozenset)  # top-level keys it set
    custom_handler: Path | None = None
    handler: BaseHandler | None = None  # the custom handler's instance, not yet initialized
    # The chat template given at registration of a .gguf file or model folder (kept in the
    # snapshot, so a restart builds — or finds — the same archive with it).
    chat_template: str | None = None

    @property
    def name(self) -> str:
        return self.manifest["model"]["modelName"]

    @property
    def version(self) -> str:
        return str(self.manifest["model"].get("modelVersion") or "1.0")


def load_archive(path: Path, allow_custom_handlers: bool, chat_template: str | None = None) -> LoadedArchive:
    """Verify and extract (once) the archive at `path` (a .gguf file or a model folder: archived
    first, once per content and chat template). Blocking: run it off the event loop."""
    if not is_archive(path):
        path = archive_from_path(path, chat_template=chat_template)
    model_dir = resolve_model_dir(path, allow_custom_handlers=allow_custom_handlers)
    # The model may sit in a folder of the archive (TorchServe's vLLM archives: model/...).
    root = next(p for p in (model_dir, *model_dir.parents) if (p / MANIFEST_PATH).is_file())
    manifest = json.loads((root / MANIFEST_PATH).read_text())
    model = manifest["model"]
    config_keys: frozenset[str] = frozenset()
    if model.get("configFile"):
        config_path = root / model["configFile"]
        if not config_path.is_file():
            config_path = model_dir / model["configFile"]
        model_config = load_model_config(config_path)
        data = yaml.safe_load(config_path.read_text()) or {}
        config_keys = frozenset(data)
    else:
        model_config = ModelConfig()
    files = {p.name: p for p in root.iterdir() if p.is_file()}
    spec = str(model.get("handler", ""))
    custom = resolve_handler(spec, files, allow_custom_handlers)
    handler = load_custom_handler(custom, spec) if custom is not None else None
    return LoadedArchive(path, model_dir, manifest, model_config, config_keys, custom, handler, chat_template)


def check_name(name: str) -> str:
    """A model name usable in URLs (TorchServe's rule); ValueError otherwise."""
    try:
        return check_model_name(name)
    except ValueError as exc:
        raise ValueError(str(exc)) from None
