"""Write a model archive: a model directory plus its manifest, as a `.mar` zip, a `.tar.gz` or a folder.

Files are streamed in chunks and hashed while they are copied; the archive is built in a hidden
temporary sibling of the destination and renamed into place at the end, so a failure or Ctrl-C
leaves nothing behind (a killed process can leave a `.NAME.tmp-*` sibling, never a half archive).
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import stat
import tarfile
import tempfile
import time
import zipfile
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from datetime import datetime
from pathlib import Path
from typing import Any, BinaryIO

from pagedserve.engine.model.archive_manifest import (
    ARCHIVER_VERSION,
    BUILTIN_HANDLER,
    CONVERT_HINT,
    CREATED_ON_FORMAT,
    MANIFEST_DIR,
    MANIFEST_PATH,
    ArchiveFormat,
    check_model_name,
    is_pickle_weights,
)
from pagedserve.engine.model.quant_spec import QuantSpec, checkpoint_spec

CHUNK_BYTES = 1 << 20
ProgressFn = Callable[[int, int], None]


@dataclass(frozen=True, slots=True)
class _Source:
    arcname: str  # path inside the archive, '/' separated
    path: Path
    size: int


@dataclass(slots=True)
class _Progress:
    total: int
    callback: ProgressFn | None
    done: int = 0

    def advance(self, n: int) -> None:
        self.done += n
        if self.callback is not None:
            self.callback(self.done, self.total)


def write_archive(
    model_dir: str | Path,
    export_path: str | Path,
    *,
    model_name: str,
    version: str,
    handler: str = BUILTIN_HANDLER,
    config_file: str | Path | None = None,
    extra_files: Iterable[str | Path] = (),
    archive_format: ArchiveFormat | str = ArchiveFormat.DEFAULT,
    force: bool = False,
    progress: ProgressFn | None = None,
    lora: dict[str, Any] | None = None,
) -> Path:
    """Package `model_dir` into `<export_path>/<model_name>.mar|.tar.gz|/`; return that path.

    The model directory's files (hidden ones and `__pycache__` skipped) go to the archive root;
    `config_file` (the model-config.yaml) and `extra_files` go to the root under their own names
    (a folder keeps its name). `handler` is `"llm"` (built in) or a path to a handler `.py` file,
    which is copied in. `MAR-INF/MANIFEST.json` follows TorchServe's schema plus a `files` map
    of each file's sha256 (see `archive_manifest`). `progress(bytes_done, bytes_total)` is called
    as data is copied. Refuses an existing destination unless `force`. With `lora` (the
    manifest's `model.lora` record, see pagedserve.engine.model.lora_archive) `model_dir` is a PEFT adapter folder.
    """
    fmt = ArchiveFormat(archive_format)
    check_model_name(model_name)
    if not isinstance(version, str) or not version.strip():
        raise ValueError(f"version must be a non-empty string, got {version!r}")
    model_dir = Path(model_dir).expanduser()
    if not model_dir.is_dir():
        raise FileNotFoundError(f"model directory {model_dir} does not exist")
    export_path = Path(export_path).expanduser().absolute()
    dest = fmt.destination(export_path, model_name)

    sources: dict[str, _Source] = {}
    _add_tree(sources, model_dir, "", exclude=dest, top_level=True)
    handler_name = _add_handler(sources, handler)
    if config_file is not None:
        _add(sources, Path(config_file).name, Path(config_file))
    for extra in extra_files:
        extra = Path(extra)
        if extra.is_dir():
            _add_tree(sources, extra, extra.name + "/", exclude=dest, top_level=False)
        else:
            _add(sources, extra.name, extra)
    model: dict[str, Any] = {"modelName": model_name, "modelVersion": version, "handler": handler_name}
    serialized, quant = _check_model(sources) if lora is None else (_check_adapter(sources), None)
    model["serializedFile"] = serialized
    if lora is not None:
        model["lora"] = lora
    if quant is not None:  # pagedserve's extension: what the weights are quantized to
        model["quantization"] = quant.record()
    if config_file is not None:
        model["configFile"] = Path(config_file).name

    if os.path.lexists(dest) and not force:
        raise FileExistsError(f"{dest} already exists; pass force=True to replace it")
    export_path.mkdir(parents=True, exist_ok=True)
    ordered = [sources[name] for name in sorted(sources)]
    tracker = _Progress(sum(s.size for s in ordered), progress)
    prefix = f".{dest.name}.tmp-"
    if fmt is ArchiveFormat.NO_ARCHIVE:
        tmp = Path(tempfile.mkdtemp(prefix=prefix, dir=export_path))
    else:
        fd, name = tempfile.mkstemp(prefix=prefix, dir=export_path)
        os.close(fd)
        tmp = Path(name)
    try:
        if fmt is ArchiveFormat.DEFAULT:
            _write_zip(tmp, ordered, model, tracker)
        elif fmt is ArchiveFormat.TGZ:
            _write_tgz(tmp, ordered, model, tracker)
        else:
            _write_dir(tmp, ordered, model, tracker)
        tmp.chmod(0o755 if fmt is ArchiveFormat.NO_ARCHIVE else 0o644)  # mkstemp/mkdtemp: private
        _publish(tmp, dest, force=force)
    except BaseException:
        _remove(tmp)
        raise
    return dest


def _add(sources: dict[str, _Source], arcname: str, path: Path) -> None:
    if arcname in sources:
        raise ValueError(f"two files would be stored as {arcname!r}: {sources[arcname].path} and {path}")
    if arcname == MANIFEST_DIR or arcname.startswith(MANIFEST_DIR + "/"):
        raise ValueError(f"{path}: {MANIFEST_DIR}/ is reserved for the archive manifest")
    try:
        st = path.stat()  # follows symlinks (Hugging Face cache snapshots are links to blobs)
    except FileNotFoundError:
        raise FileNotFoundError(f"file {path} does not exist") from None
    if not stat.S_ISREG(st.st_mode):
        raise ValueError(f"{path} is not a regular file")
    sources[arcname] = _Source(arcname, path, st.st_size)


def _add_tree(sources: dict[str, _Source], folder: Path, prefix: str, *, exclude: Path, top_level: bool) -> None:
    exclude = exclude.absolute()
    for root, dirs, files in os.walk(folder):
        here = Path(root)
        dirs[:] = sorted(
            d
            for d in dirs
            if not d.startswith(".") and d != "__pycache__" and not (top_level and here == folder and d == MANIFEST_DIR)
        )
        for d in dirs:
            if (here / d).is_symlink():
                raise ValueError(f"{here / d} is a link to a folder; archive its target instead")
        for name in sorted(files):
            path = here / name
            if name.startswith(".") or path.absolute() == exclude or exclude in path.absolute().parents:
                continue
            _add(sources, prefix + path.relative_to(folder).as_posix(), path)


def _add_handler(sources: dict[str, _Source], handler: str) -> str:
    if handler == BUILTIN_HANDLER:
        return handler
    module, sep, func = handler.partition(":")
    path = Path(module).expanduser()
    if path.suffix != ".py" or not path.is_file():
        raise ValueError(f"handler must be {BUILTIN_HANDLER!r} or the path of a handler .py file, got {handler!r}")
    _add(sources, path.name, path)
    return path.name + sep + func


def _check_model(sources: dict[str, _Source]) -> tuple[str, QuantSpec | None]:
    """Refuse what open_archive would refuse; return the main weights file (serializedFile) and
    the quantization config.json records."""
    pickled = sorted(name for name in sources if is_pickle_weights(name))
    if pickled:
        raise ValueError(f"weights in a pickle format ({', '.join(pickled)}); {CONVERT_HINT}")
    if "config.json" not in sources:
        raise ValueError("the model directory has no config.json")
    with open(sources["config.json"].path, "rb") as f:
        config = json.load(f)
    from pagedserve.engine.model.registry import architecture_of  # the families import torch: only here

    architecture_of(config)  # ValueError names the architecture and what is supported
    quant = checkpoint_spec(config)  # ValueError on a malformed record
    weights = sorted(name for name in sources if name.endswith(".safetensors") and "/" not in name)
    if not weights:
        raise ValueError("the model directory has no *.safetensors weights")
    for preferred in ("model.safetensors.index.json", "model.safetensors"):
        if preferred in sources:
            return preferred, quant
    return weights[0], quant


def _check_adapter(sources: dict[str, _Source]) -> str:
    from pagedserve.engine.lora.adapter import CONFIG_FILE, WEIGHTS_FILE, read_adapter_config

    missing = [name for name in (CONFIG_FILE, WEIGHTS_FILE) if name not in sources]
    if missing:
        raise ValueError(f"the adapter folder has no {' or '.join(missing)}")
    read_adapter_config(sources[CONFIG_FILE].path.parent)  # ValueError for what cannot be served
    return WEIGHTS_FILE


def _manifest(model: dict[str, Any], hashes: dict[str, str]) -> bytes:
    manifest = {
        "createdOn": datetime.now().strftime(CREATED_ON_FORMAT),
        "runtime": "python",
        "model": model,
        "archiverVersion": ARCHIVER_VERSION,
        "files": dict(sorted(hashes.items())),
    }
    return json.dumps(manifest, indent=2).encode() + b"\n"


def _copy(source: _Source, write: Callable[[bytes], Any], tracker: _Progress) -> str:
    """Stream `source` into `write`; return its sha256. The size must not change meanwhile."""
    digest = hashlib.sha256()
    copied = 0
    with open(source.path, "rb") as f:
        while chunk := f.read(CHUNK_BYTES):
            digest.update(chunk)
            write(chunk)
            copied += len(chunk)
            tracker.advance(len(chunk))
    if copied != source.size:
        raise OSError(f"{source.path} changed size while it was archived")
    return digest.hexdigest()


class _HashingReader:
    """File-like reader for tarfile.addfile that hashes and reports what it hands out."""

    def __init__(self, f: BinaryIO, tracker: _Progress) -> None:
        self._f, self._tracker, self.digest = f, tracker, hashlib.sha256()

    def read(self, n: int = -1) -> bytes:
        chunk = self._f.read(n if 0 < n <= CHUNK_BYTES else CHUNK_BYTES)
        self.digest.update(chunk)
        self._tracker.advance(len(chunk))
        return chunk


def _write_zip(tmp: Path, sources: list[_Source], model: dict[str, Any], tracker: _Progress) -> None:
    hashes: dict[str, str] = {}
    with open(tmp, "wb") as raw:
        with zipfile.ZipFile(raw, "w") as zf:
            for s in sources:
                info = _zip_info(s.arcname, s.path.stat().st_mtime)
                # safetensors barely compress and deflating GBs is slow: store them as they are
                info.compress_type = zipfile.ZIP_STORED if s.arcname.endswith(".safetensors") else zipfile.ZIP_DEFLATED
                info.file_size = s.size  # lets zipfile pick ZIP64 up front for big files
                with zf.open(info, "w") as dst:
                    hashes[s.arcname] = _copy(s, dst.write, tracker)
            info = _zip_info(MANIFEST_PATH, time.time())
            info.compress_type = zipfile.ZIP_DEFLATED
            zf.writestr(info, _manifest(model, hashes))
        raw.flush()
        os.fsync(raw.fileno())


def _zip_info(name: str, mtime: float) -> zipfile.ZipInfo:
    info = zipfile.ZipInfo(name, date_time=max(time.localtime(mtime)[:6], (1980, 1, 1, 0, 0, 0)))
    info.external_attr = (stat.S_IFREG | 0o644) << 16
    return info


def _write_tgz(tmp: Path, sources: list[_Source], model: dict[str, Any], tracker: _Progress) -> None:
    hashes: dict[str, str] = {}
    with open(tmp, "wb") as raw:
        # level 1: weights barely compress, and level 9 costs several times the time
        with tarfile.open(
            fileobj=raw, mode="w:gz", compresslevel=1, format=tarfile.PAX_FORMAT, copybufsize=CHUNK_BYTES
        ) as tf:  # type: ignore[call-overload]  # typeshed's tarfile.open omits TarFile's copybufsize
            for s in sources:
                info = _tar_info(s.arcname, s.size, s.path.stat().st_mtime)
                with open(s.path, "rb") as f:
                    reader = _HashingReader(f, tracker)
                    tf.addfile(info, reader)  # reads exactly info.size bytes, else raises
                hashes[s.arcname] = reader.digest.hexdigest()
            data = _manifest(model, hashes)
            tf.addfile(_tar_info(MANIFEST_PATH, len(data), time.time()), _BytesReader(data))
        raw.flush()
        os.fsync(raw.fileno())


class _BytesReader:
    def __init__(self, data: bytes) -> None:
        self._data, self._pos = data, 0

    def read(self, n: int = -1) -> bytes:
        end = len(self._data) if n < 0 else self._pos + n
        chunk, self._pos = self._data[self._pos : end], min(end, len(self._data))
        return chunk


def _tar_info(name: str, size: int, mtime: float) -> tarfile.TarInfo:
    info = tarfile.TarInfo(name)
    info.size, info.mtime, info.mode = size, int(mtime), 0o644
    return info


def _write_dir(tmp: Path, sources: list[_Source], model: dict[str, Any], tracker: _Progress) -> None:
    hashes: dict[str, str] = {}
    for s in sources:
        target = tmp / s.arcname
        target.parent.mkdir(parents=True, exist_ok=True)
        with open(target, "wb") as dst:
            hashes[s.arcname] = _copy(s, dst.write, tracker)
    (tmp / MANIFEST_DIR).mkdir(exist_ok=True)
    (tmp / MANIFEST_PATH).write_bytes(_manifest(model, hashes))


def _publish(tmp: Path, dest: Path, *, force: bool) -> None:
    """Move the finished `tmp` to `dest` in one rename (replacing `dest` only when `force`)."""
    if tmp.is_dir():
        if not os.path.lexists(dest):
            os.rename(tmp, dest)  # fails if a folder with files appeared at dest meanwhile
            return
        old = Path(tempfile.mkdtemp(prefix=f".{dest.name}.old-", dir=dest.parent))
        os.rename(dest, old / dest.name)
        try:
            os.rename(tmp, dest)
        except BaseException:
            os.rename(old / dest.name, dest)
            _remove(old)
            raise
        _remove(old)
    elif force:
        os.replace(tmp, dest)
    else:
        os.link(tmp, dest)  # FileExistsError rather than clobbering a file that just appeared
        os.unlink(tmp)


def _remove(path: Path) -> None:
    if path.is_dir() and not path.is_symlink():
        shutil.rmtree(path, ignore_errors=True)
    else:
        try:
            path.unlink()
        except FileNotFoundError:
            pass
