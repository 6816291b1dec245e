"""The disk tier's folder: a writability probe at start and a size budget.

LMCache's `fs` storage plugin writes one file per chunk (`<key>.data`, through a `.tmp` file
renamed into place) and looks keys up by file existence, so the folder serves hits to a new
process. It has no size limit of its own: `DiskBudget` keeps the folder under `disk_size_gb` by
deleting the least recently written chunk files (a deleted file is simply a miss).
"""

from __future__ import annotations

import os
import uuid
from pathlib import Path

DATA_SUFFIX = ".data"


def check_writable(path: Path) -> None:
    """Create the folder if needed and write + remove a probe file; raises OSError if not possible."""
    path.mkdir(parents=True, exist_ok=True)
    probe = path / f".probe-{uuid.uuid4().hex}"
    with open(probe, "wb") as f:
        f.write(b"0")
    probe.unlink()


class DiskBudget:
    """Tracks the bytes of chunk files under `path`; prunes the oldest past `limit_bytes`.

    The count is an estimate between scans (writes are asynchronous, so the folder can run
    over while writes are queued); each prune rescans, and `enforce()` after the writes landed
    brings it back under the limit.
    """

    def __init__(self, path: Path, limit_bytes: int, low_water: float = 0.9) -> None:
        self.path = path
        self.limit_bytes = limit_bytes
        self.low_water = low_water
        self.estimate = sum(size for _, size, _ in self._files())

    def _files(self) -> list[tuple[float, int, Path]]:
        out: list[tuple[float, int, Path]] = []
        try:
            entries = list(os.scandir(self.path))
        except OSError:
            return out
        for entry in entries:
            if entry.name.endswith(DATA_SUFFIX):
                try:
                    st = entry.stat()
                except OSError:
                    continue  # deleted meanwhile
                out.append((st.st_mtime, st.st_size, Path(entry.path)))
        return out

    def account(self, nbytes: int) -> int:
        """Count `nbytes` about to be written; prune if over budget. Returns files deleted."""
        self.estimate += nbytes
        if self.estimate <= self.limit_bytes:
            return 0
        return self.prune(reserve=nbytes)

    def enforce(self) -> int:
        """Rescan (after asynchronous writes landed) and prune if the folder is over the limit."""
        if sum(size for _, size, _ in self._files()) <= self.limit_bytes:
            return 0
        return self.prune()

    def prune(self, reserve: int = 0) -> int:
        files = sorted(self._files())
        total = sum(size for _, size, _ in files) + reserve
        target = self.low_water * self.limit_bytes
        deleted = 0
        for _, size, path in files:
            if total <= target:
                break
            try:
                path.unlink()
            except FileNotFoundError:
                pass
            except OSError:
                continue
            total -= size
            deleted += 1
        self.estimate = total
        return deleted
