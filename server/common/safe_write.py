"""Writing a small file so that readers see the old content or the new one, never a mix, and
nobody can redirect the write: the snapshot and the key file.

The new content goes to a temporary file in the same folder, created with
O_CREAT|O_EXCL|O_NOFOLLOW (so an existing file or a planted symlink at that name is never
opened, let alone written through) under a random name, with mode 0600; it is fsynced, renamed
over the target (a rename replaces a link at the target, it does not follow it) and the folder
is fsynced so that the rename itself survives a crash. A failed write removes its temporary
file and raises the OSError, whose errno says why (ENOSPC: the disk is full).
"""

from __future__ import annotations

import contextlib
import errno
import os
import secrets
from pathlib import Path

MODE = 0o600
_CREATE = os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | getattr(os, "O_CLOEXEC", 0)
_ATTEMPTS = 16  # random names that all exist already: something is wrong with the folder
# errnos that mean "there is no room for it" (HTTP 507 Insufficient Storage)
NO_SPACE = frozenset({errno.ENOSPC, errno.EDQUOT, errno.EFBIG})


def write_atomically(path: str | Path, data: bytes) -> Path:
    """Replace `path` with `data` (mode 0600), atomically and durably; return the path."""
    path = Path(path).expanduser().absolute()
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = _create_temp(path)
    try:
        try:
            os.fchmod(fd, MODE)  # O_CREAT's mode is masked by the umask; make it exact
            view = memoryview(data)
            while view:
                view = view[os.write(fd, view) :]
            os.fsync(fd)
        finally:
            os.close(fd)
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(tmp)
        raise
    _fsync_folder(path.parent)
    return path


def _create_temp(path: Path) -> tuple[int, Path]:
    for _ in range(_ATTEMPTS):
        tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}-{secrets.token_hex(6)}")
        try:
            return os.open(tmp, _CREATE, MODE), tmp
        except FileExistsError:
            continue
    raise FileExistsError(errno.EEXIST, f"could not create a temporary file next to {path}")


def _fsync_folder(folder: Path) -> None:
    try:
        fd = os.open(folder, os.O_RDONLY | getattr(os, "O_DIRECTORY", 0))
    except OSError:
        return  # a platform that cannot open folders: the rename is all we can do
    try:
        os.fsync(fd)
    except OSError as exc:
        if exc.errno not in (errno.EINVAL, errno.EBADF):  # folders that cannot be fsynced
            raise
    finally:
        os.close(fd)
