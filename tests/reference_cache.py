"""Reference outputs computed by another implementation (transformers' greedy tokens) kept in the
user cache, once per machine: a reference costs tens of CPU-seconds (Gemma 3 270M's GGUF read and
de-quantized by transformers; the default model generating on a 1,500-token prompt) and does not
change between runs. The key holds everything the reference depends on: the test's name and
parameters (prompts, token counts), the source files (path, size, modification time) and the
versions of transformers, torch and the `gguf` package; anything changed computes it afresh.
PAGEDSERVE_TEST_FRESH_REFERENCES=1 ignores the cache (and refreshes it)."""

from __future__ import annotations

import fcntl
import hashlib
import json
import os
from collections.abc import Callable
from importlib.metadata import PackageNotFoundError, version
from pathlib import Path
from typing import Any


def _versions() -> dict[str, str]:
    out = {}
    for package in ("transformers", "torch", "gguf", "tokenizers"):
        try:
            out[package] = version(package)
        except PackageNotFoundError:
            out[package] = "-"
    return out


def _files(source: Path) -> list[list[Any]]:
    files = [source] if source.is_file() else sorted(p for p in source.rglob("*") if p.is_file())
    return [[str(p.resolve()), p.stat().st_size, p.stat().st_mtime_ns] for p in files]


def cached_reference(name: str, sources: list[Path], params: Any, compute: Callable[[], Any]) -> Any:
    """`compute()` (JSON-serializable), or what it returned before for the same key."""
    from pagedserve.engine.model.default_model import default_cache_dir

    key = json.dumps(
        {"name": name, "params": params, "files": [_files(Path(s)) for s in sources], "versions": _versions()},
        sort_keys=True,
    )
    folder = default_cache_dir() / "tests" / "references"
    folder.mkdir(parents=True, exist_ok=True)
    path = folder / f"{name}-{hashlib.sha256(key.encode()).hexdigest()[:16]}.json"
    with open(folder / f".{path.name}.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)  # parallel workers compute it once
        if path.is_file() and not os.environ.get("PAGEDSERVE_TEST_FRESH_REFERENCES"):
            return json.loads(path.read_text())["value"]
        value = json.loads(json.dumps(compute()))  # as a cached one reads: lists, not tuples
        tmp = path.with_suffix(".tmp")
        tmp.write_text(json.dumps({"key": json.loads(key), "value": value}))
        tmp.replace(path)
    return value
