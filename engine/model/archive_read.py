"""Open a model archive safely: a `.mar`/`.zip`, a `.tar.gz`/`.tgz` (any tar), or a folder.

Archives are checked entry by entry before anything is written (names, entry types, links,
declared sizes), extracted into a hidden temporary sibling of `dest_dir` while counting and
hashing the bytes, verified against the manifest, then renamed to `dest_dir`. Any refusal raises
`ArchiveError` and leaves nothing on disk. The extracted tree holds only folders and regular
files: a link that stays inside the archive and names a file is materialised as a copy.
"""

from __future__ import annotations

import enum
import functools
import gzip
import hashlib
import json
import lzma
import os
import posixpath
import re
import shutil
import stat
import tarfile
import tempfile
import zipfile
import zlib
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import IO, Any

from pagedserve.engine.model.archive_manifest import (
    CONVERT_HINT,
    MANIFEST_PATH,
    ArchiveError,
    is_pickle_weights,
    resolve_handler,
    validate_manifest,
)
from pagedserve.engine.model.model_config import ModelConfig, ModelConfigError, load_model_config

DEFAULT_MAX_TOTAL_BYTES = 64 << 30
MAX_ENTRIES = 100_000
CHUNK_BYTES = 1 << 20
_MAX_JSON_BYTES = 16 << 20  # manifest and config.json are small; do not read a huge one
# What a damaged or hostile archive raises while being read (not disk errors: those stay OSError).
_CORRUPT = (
    zipfile.BadZipFile,
    zipfile.LargeZipFile,
    tarfile.TarError,
    zlib.error,
    EOFError,
    gzip.BadGzipFile,
    lzma.LZMAError,
    NotImplementedError,
    UnicodeError,
)


class _Kind(enum.Enum):
    FILE = "file"
    DIR = "folder"
    LINK = "link"


@dataclass(frozen=True, slots=True)
class _Entry:
    name: str  # normalised: '/' separated, no '.', '..' or empty parts; '' is the root
    kind: _Kind
    size: int = 0
    target: str | None = None  # links: the archive path of the file it points to
    member: Any = None  # the zipfile.ZipInfo or tarfile.TarInfo


@dataclass(frozen=True, slots=True)
class OpenedArchive:
    """A verified archive: `root` is the model directory (config.json, weights, tokenizer)."""

    root: Path
    manifest: dict[str, Any]
    model_config: Path | None  # the model-config.yaml named by manifest model.configFile
    custom_handler: Path | None  # a handler .py shipped in the archive (only when allowed)


def open_archive(
    path: str | Path,
    dest_dir: str | Path,
    *,
    max_total_bytes: int = DEFAULT_MAX_TOTAL_BYTES,
    allow_custom_handlers: bool = False,
) -> OpenedArchive:
    """Verify the archive at `path` and extract it to `dest_dir` (a folder is verified in place).

    `dest_dir` must not exist or be empty; it becomes the archive's top folder. Refuses (with
    `ArchiveError`, leaving nothing behind) unsafe entries, more than `max_total_bytes` of
    content, a missing or malformed manifest, files that do not match its sha256 map, pickle
    weights, an unsupported architecture, an invalid model-config.yaml, and handler code unless
    `allow_custom_handlers`.
    """
    path = Path(path).expanduser()
    if path.is_dir():
        return _verify(path, _scan_folder(path, max_total_bytes), allow_custom_handlers)
    if not path.is_file():
        raise FileNotFoundError(f"archive {path} does not exist")
    dest = Path(dest_dir).expanduser().absolute()
    if dest.exists() and (not dest.is_dir() or any(dest.iterdir())):
        raise FileExistsError(f"{dest} already exists and is not an empty folder")
    dest.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{dest.name}.tmp-", dir=dest.parent))
    try:
        try:
            with _open_members(path) as (entries, open_member):
                _check_entries(entries, max_total_bytes)
                hashes = _extract(entries, open_member, tmp, max_total_bytes)
        except _CORRUPT as exc:
            raise ArchiveError(f"{path.name} is corrupt or unsupported: {exc}") from exc
        opened = _verify(tmp, hashes, allow_custom_handlers)
        tmp.chmod(0o755)
        os.replace(tmp, dest)  # dest is absent or an empty folder
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise

    def rebase(p: Path | None) -> Path | None:
        return None if p is None else dest / p.relative_to(tmp)

    return OpenedArchive(
        dest / opened.root.relative_to(tmp), opened.manifest, rebase(opened.model_config), rebase(opened.custom_handler)
    )


# ---- listing entries -------------------------------------------------------------------------

OpenMember = Callable[[_Entry], IO[bytes]]


@contextmanager
def _open_members(path: Path) -> Iterator[tuple[list[_Entry], OpenMember]]:
    if zipfile.is_zipfile(path):
        with zipfile.ZipFile(path) as zf:
            yield _zip_entries(zf), lambda e: zf.open(e.member)
    elif tarfile.is_tarfile(path):
        with tarfile.open(path, "r:*") as tf:
            yield _tar_entries(tf), functools.partial(_open_tar_member, tf)
    else:
        raise ArchiveError(f"{path.name} is neither a zip (.mar) nor a tar (.tar.gz) archive")


def _zip_entries(zf: zipfile.ZipFile) -> list[_Entry]:
    infos = zf.infolist()
    if len(infos) > MAX_ENTRIES:
        raise ArchiveError(f"archive has {len(infos)} entries; at most {MAX_ENTRIES} are allowed")
    entries = []
    for info in infos:
        name = _safe_name(info.filename)
        if info.flag_bits & 0x1:
            raise ArchiveError(f"entry {name!r} is encrypted")
        ftype = stat.S_IFMT(info.external_attr >> 16)
        if ftype == stat.S_IFLNK:
            if info.file_size > 4096:
                raise ArchiveError(f"link entry {name!r} is too long")
            target = zf.read(info).decode("utf-8")
            entries.append(_Entry(name, _Kind.LINK, target=_link_target(name, target, True)))
        elif ftype not in (0, stat.S_IFREG, stat.S_IFDIR):
            raise ArchiveError(f"entry {name!r} is a device file, fifo or socket")
        elif info.is_dir() or ftype == stat.S_IFDIR:
            entries.append(_Entry(name, _Kind.DIR))
        else:
            entries.append(_Entry(name, _Kind.FILE, info.file_size, member=info))
    return entries


def _open_tar_member(tf: tarfile.TarFile, entry: _Entry) -> IO[bytes]:
    file = tf.extractfile(entry.member)
    if file is None:  # only regular files are FILE entries
        raise ArchiveError(f"{entry.name} is not a regular file")
    return file


def _tar_entries(tf: tarfile.TarFile) -> list[_Entry]:
    entries: list[_Entry] = []
    for member in tf:  # reads headers only; stops early on the first refusal
        if len(entries) >= MAX_ENTRIES:
            raise ArchiveError(f"archive has more than {MAX_ENTRIES} entries")
        name = _safe_name(member.name)
        if member.isreg():
            if member.issparse():
                raise ArchiveError(f"entry {name!r} is a sparse file")
            entries.append(_Entry(name, _Kind.FILE, member.size, member=member))
        elif member.isdir():
            entries.append(_Entry(name, _Kind.DIR))
        elif member.issym() or member.islnk():
            target = _link_target(name, member.linkname, member.issym())
            entries.append(_Entry(name, _Kind.LINK, target=target))
        else:
            raise ArchiveError(f"entry {name!r} is a device file, fifo or other special file")
    return entries


def _safe_name(raw: str) -> str:
    if not raw or "\x00" in raw:
        raise ArchiveError(f"entry with an empty or invalid name {raw!r}")
    if "\\" in raw:
        raise ArchiveError(f"entry {raw!r} contains a backslash")
    if raw.startswith("/") or re.match(r"^[A-Za-z]:", raw):
        raise ArchiveError(f"entry {raw!r} is an absolute path")
    parts = [p for p in raw.split("/") if p not in ("", ".")]
    if ".." in parts:
        raise ArchiveError(f"entry {raw!r} contains '..'")
    return "/".join(parts)


def _link_target(name: str, target: str, symlink: bool) -> str:
    """The archive path a link resolves to; symlinks are relative to their folder, hardlinks
    to the archive root. Refuses links that leave the archive."""
    if not target or "\x00" in target or "\\" in target or target.startswith("/"):
        raise ArchiveError(f"link {name!r} -> {target!r} points outside the archive")
    resolved = posixpath.normpath(posixpath.join(posixpath.dirname(name) if symlink else "", target))
    if resolved == ".":
        raise ArchiveError(f"link {name!r} -> {target!r} names a folder, not a file")
    if resolved == ".." or resolved.startswith("../"):
        raise ArchiveError(f"link {name!r} -> {target!r} points outside the archive")
    return resolved


def _check_entries(entries: list[_Entry], max_total_bytes: int) -> None:
    """Duplicates, entries under a file or link, link targets, and the declared total size."""
    seen: dict[str, _Entry] = {}
    for e in entries:
        if not e.name:
            if e.kind is not _Kind.DIR:
                raise ArchiveError("entry with an empty name")
            continue
        prev = seen.get(e.name)
        if prev is not None and not (prev.kind is _Kind.DIR and e.kind is _Kind.DIR):
            raise ArchiveError(f"duplicate entry {e.name!r}")
        seen[e.name] = e
    total = 0
    for e in seen.values():
        parts = e.name.split("/")
        for i in range(1, len(parts)):
            parent = seen.get("/".join(parts[:i]))
            if parent is not None and parent.kind is not _Kind.DIR:
                raise ArchiveError(f"entry {e.name!r} lies under {parent.name!r}, which is a {parent.kind.value}")
        if e.kind is _Kind.LINK:
            target = seen.get(e.target or "")
            if target is None or target.kind is not _Kind.FILE:
                raise ArchiveError(f"link {e.name!r} -> {e.target!r} does not name a regular file in the archive")
            total += target.size
        total += e.size
    if total > max_total_bytes:
        raise ArchiveError(f"archive declares {total} bytes of content, over the limit of {max_total_bytes} bytes")


# ---- extracting ------------------------------------------------------------------------------


def _extract(entries: list[_Entry], open_member: OpenMember, top: Path, max_total_bytes: int) -> dict[str, str]:
    """Write folders and files under `top`, counting real bytes; return {name: sha256}."""
    hashes: dict[str, str] = {}
    total = 0
    for e in entries:
        if e.kind is _Kind.DIR and e.name:
            (top / e.name).mkdir(parents=True, exist_ok=True)
    for e in entries:
        if e.kind is not _Kind.FILE:
            continue
        target = top / e.name
        target.parent.mkdir(parents=True, exist_ok=True)
        digest, size = hashlib.sha256(), 0
        fd = os.open(target, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o644)
        with os.fdopen(fd, "wb") as out, open_member(e) as src:
            while chunk := src.read(CHUNK_BYTES):
                size += len(chunk)
                total += len(chunk)
                if size > e.size:
                    raise ArchiveError(f"entry {e.name!r} holds more bytes than the {e.size} it declares")
                if total > max_total_bytes:
                    raise ArchiveError(f"archive content exceeds the limit of {max_total_bytes} bytes")
                digest.update(chunk)
                out.write(chunk)
        if size != e.size:
            raise ArchiveError(f"entry {e.name!r} is truncated ({size} of {e.size} bytes)")
        hashes[e.name] = digest.hexdigest()
    for e in entries:
        if e.kind is _Kind.LINK:
            assert e.target is not None
            total += (top / e.target).stat().st_size
            if total > max_total_bytes:
                raise ArchiveError(f"archive content exceeds the limit of {max_total_bytes} bytes")
            (top / e.name).parent.mkdir(parents=True, exist_ok=True)
            shutil.copyfile(top / e.target, top / e.name)
            hashes[e.name] = hashes[e.target]
    return hashes


def _scan_folder(folder: Path, max_total_bytes: int) -> dict[str, str]:
    """Hash every file of an archive folder in place; refuse links leaving it and special files."""
    base = folder.resolve()
    files: list[tuple[str, Path]] = []
    total = 0
    for root, dirs, names in os.walk(folder):
        here = Path(root)
        for name in sorted(dirs) + sorted(names):
            path = here / name
            rel = path.relative_to(folder).as_posix()
            st = os.lstat(path)
            if stat.S_ISLNK(st.st_mode):
                resolved = path.resolve()
                if resolved != base and base not in resolved.parents:
                    raise ArchiveError(f"link {rel!r} points outside the archive folder")
                st = resolved.stat()
                if not stat.S_ISREG(st.st_mode):
                    raise ArchiveError(f"link {rel!r} does not name a regular file")
            elif stat.S_ISDIR(st.st_mode):
                continue
            elif not stat.S_ISREG(st.st_mode):
                raise ArchiveError(f"{rel!r} is a device file, fifo or socket")
            total += st.st_size
            if total > max_total_bytes:
                raise ArchiveError(f"archive content exceeds the limit of {max_total_bytes} bytes")
            files.append((rel, path))
    return {rel: _sha256(path) for rel, path in files}


def _sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(CHUNK_BYTES):
            digest.update(chunk)
    return digest.hexdigest()


# ---- verifying -------------------------------------------------------------------------------


def _verify(top: Path, hashes: dict[str, str], allow_custom_handlers: bool) -> OpenedArchive:
    """Check the extracted tree at `top` (whose files hash to `hashes`) against its manifest."""
    root_rel = _archive_root(hashes)
    prefix = f"{root_rel}/" if root_rel else ""
    content = {n[len(prefix) :]: h for n, h in hashes.items() if n != prefix + MANIFEST_PATH}
    root = top / root_rel
    manifest = validate_manifest(_read_json(root / MANIFEST_PATH, MANIFEST_PATH, "malformed"))
    model = manifest["model"]

    pickled = sorted(n for n in content if is_pickle_weights(n))
    if pickled:
        raise ArchiveError(f"archive holds weights in a pickle format ({', '.join(pickled)}); {CONVERT_HINT}")
    custom = resolve_handler(model["handler"], {n: root / n for n in content}, allow_custom_handlers)
    if "files" in manifest:
        _check_hashes(manifest["files"], content)
    if "lora" in model:  # a LoRA adapter archive (pagedserve.engine.model.lora_archive): no model of its own
        from pagedserve.engine.model.lora_archive import check_lora_record

        check_lora_record(model["lora"], content)
        return OpenedArchive(root, manifest, None, custom)

    configs = sorted({posixpath.dirname(n) for n in content if posixpath.basename(n) == "config.json"})
    model_rel = "" if "config.json" in content else (configs[0] if len(configs) == 1 else None)
    if model_rel is None:
        where = f"several ({', '.join(configs)})" if configs else "none"
        raise ArchiveError(f"cannot find the model directory: it needs exactly one config.json, found {where}")
    model_prefix = f"{model_rel}/" if model_rel else ""
    hf_config = _read_json(root / model_prefix / "config.json", "config.json", "invalid")
    from pagedserve.engine.model.registry import architecture_of  # the families import torch: only here

    try:
        architecture_of(hf_config)
    except ValueError as exc:
        raise ArchiveError(f"the archive's model is not supported: {exc}") from None
    if not any(n.startswith(model_prefix) and n.endswith(".safetensors") for n in content):
        raise ArchiveError("the archive holds no *.safetensors weights")
    for key in ("serializedFile", "configFile"):
        if key in model and model[key] not in content and model_prefix + model[key] not in content:
            raise ArchiveError(f"manifest model.{key} names {model[key]!r}, which is not in the archive")
    config_rel = model.get("configFile")
    model_config = None
    if config_rel is not None:
        model_config = root / (config_rel if config_rel in content else model_prefix + config_rel)
        try:
            _check_tensor_parallel(load_model_config(model_config), hf_config)
        except ModelConfigError as exc:
            raise ArchiveError(f"invalid model config: {exc}") from None
    return OpenedArchive(root / model_rel, manifest, model_config, custom)


def _check_tensor_parallel(config: ModelConfig, hf_config: Any) -> None:
    """A tensor-parallel size that the model's heads, MLP or vocabulary do not divide is refused
    when the archive is opened (naming the sizes), not when its worker starts."""
    size = config.engine_options().get("tensor_parallel_size", 1)
    if size == 1:
        return
    from pagedserve.engine.model.registry import check_tensor_parallel_support, parse_config
    from pagedserve.engine.model.sharding import check_tensor_parallel

    try:
        spec = parse_config(hf_config)
        check_tensor_parallel_support(spec, size)
        check_tensor_parallel(spec, size)
    except ValueError as exc:
        raise ModelConfigError(f"{config.source}: {exc}") from None


def _archive_root(hashes: dict[str, str]) -> str:
    """'' when the manifest is at the top, else the one top folder holding it (as in
    torch-model-archiver's .tar.gz, which wraps everything in a `<model_name>/` folder)."""
    if MANIFEST_PATH in hashes:
        return ""
    tops = {n.split("/", 1)[0] for n in hashes}
    if len(tops) == 1:
        (top,) = tops
        if f"{top}/{MANIFEST_PATH}" in hashes and all("/" in n for n in hashes):
            return top
    raise ArchiveError(f"missing {MANIFEST_PATH}: not a model archive")


def _read_json(path: Path, label: str, adjective: str) -> Any:
    if path.stat().st_size > _MAX_JSON_BYTES:
        raise ArchiveError(f"{adjective} {label}: larger than {_MAX_JSON_BYTES} bytes")
    try:
        return json.loads(path.read_bytes())
    except (UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise ArchiveError(f"{adjective} {label}: not valid JSON ({exc})") from None


def _check_hashes(listed: dict[str, str], content: dict[str, str]) -> None:
    missing = sorted(set(listed) - set(content))
    if missing:
        raise ArchiveError(f"files listed in the manifest are missing: {', '.join(missing)}")
    unlisted = sorted(set(content) - set(listed))
    if unlisted:
        raise ArchiveError(f"files not listed in the manifest: {', '.join(unlisted)}")
    bad = sorted(n for n in listed if listed[n] != content[n])
    if bad:
        raise ArchiveError(f"sha256 mismatch for {', '.join(bad)}: the archive is corrupt or was modified")
