"""Where a model comes from: a model directory, or a packaged archive opened (once) into a cache."""

from __future__ import annotations

import fcntl
import hashlib
import os
import shutil
from pathlib import Path

from pagedserve.engine.model.archive import MANIFEST_PATH, open_archive

ARCHIVE_SUFFIXES = (".mar", ".zip", ".tar.gz", ".tgz")


def is_archive(path: Path) -> bool:
    return (path.is_file() and path.name.endswith(ARCHIVE_SUFFIXES)) or (path / MANIFEST_PATH).is_file()


def archive_cache_dir() -> Path:
    """$PAGEDSERVE_ARCHIVE_DIR, else `archives/` in $PAGEDSERVE_CACHE_DIR (~/.cache/pagedserve)."""
    if os.environ.get("PAGEDSERVE_ARCHIVE_DIR"):
        return Path(os.environ["PAGEDSERVE_ARCHIVE_DIR"])
    base = Path(os.environ.get("PAGEDSERVE_CACHE_DIR", Path.home() / ".cache" / "pagedserve"))
    return base / "archives"


def resolve_model_dir(model: str | Path, *, allow_custom_handlers: bool = False, cache_dir: Path | None = None) -> Path:
    """The model directory to load for `model`.

    A plain directory (config.json + safetensors) is used as is. An archive (`.mar`, `.tar.gz`,
    or a folder with MAR-INF/MANIFEST.json) is verified exactly as the server would; an archive
    file is extracted once into the cache, keyed by its file (inode), size and mtime (a changed
    archive is opened afresh), under a lock so concurrent processes extract it once.
    """
    path = Path(model).expanduser()
    if not path.exists():
        raise FileNotFoundError(f"model {str(model)!r} does not exist")
    if not is_archive(path):
        return path
    if path.is_dir():
        return open_archive(path, path, allow_custom_handlers=allow_custom_handlers).root
    stat = path.stat()
    # The file itself (device and inode: hard links to one archive share its extraction), its
    # size and mtime.
    key = hashlib.sha256(f"{stat.st_dev}|{stat.st_ino}|{stat.st_size}|{stat.st_mtime_ns}".encode()).hexdigest()[:16]
    cache = cache_dir or archive_cache_dir()
    cache.mkdir(parents=True, exist_ok=True)
    dest = cache / f"{path.name}-{key}"
    with open(cache / f".{dest.name}.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if dest.exists():
            # Extracted by an earlier run: verify it again in place (hashes, handler, config).
            try:
                return open_archive(dest, dest, allow_custom_handlers=allow_custom_handlers).root
            except ValueError:
                shutil.rmtree(dest)
        return open_archive(path, dest, allow_custom_handlers=allow_custom_handlers).root
