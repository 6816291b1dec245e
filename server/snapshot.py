"""Snapshots of the registered models, so registrations survive a restart.

The file holds, per model version: name, version, archive URL, min/max workers and whether it
is the default version. It is rewritten atomically (temporary file + rename) whenever the
registry changes, and read back at start. An entry that could not be restored (its archive
gone or unreadable) is carried over into every later save, so that a start with a missing or
broken archive loses no registration: fix the archive and restart. Starting once with `--ncs`
(no restore) drops what is not registered.
"""

from __future__ import annotations

import json
import logging
import os
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from server.registry import ModelRegistry

logger = logging.getLogger(__name__)
FORMAT = 1


@dataclass(frozen=True, slots=True)
class SnapshotEntry:
    name: str
    version: str
    url: str
    min_workers: int
    max_workers: int
    default: bool


def entries_of(registry: ModelRegistry) -> list[SnapshotEntry]:
    out = []
    for model in registry.sorted_models():
        for version in sorted(model.versions):
            v = model.versions[version]
            out.append(SnapshotEntry(v.name, v.version, v.url, v.min_workers, v.max_workers,
                                     version == model.default_version))
    return out


class Snapshotter:
    """Writes the registry's snapshot to `path` when its content changed."""

    def __init__(self, path: str | Path) -> None:
        self.path = Path(path).expanduser().absolute()
        self.carried: list[SnapshotEntry] = []  # entries not restored, kept for the next start
        self._last: str | None = None

    def save(self, registry: ModelRegistry) -> None:
        entries = entries_of(registry)
        registered = {(e.name, e.version) for e in entries}
        entries += [e for e in self.carried if (e.name, e.version) not in registered]
        text = json.dumps({"format": FORMAT, "models": [asdict(e) for e in entries]},
                          indent=2) + "\n"
        if text == self._last:
            return
        self.path.parent.mkdir(parents=True, exist_ok=True)
        tmp = self.path.with_name(f".{self.path.name}.tmp-{os.getpid()}")
        with open(tmp, "w") as f:
            f.write(text)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, self.path)
        self._last = text

    def load(self) -> list[SnapshotEntry]:
        """The saved entries; [] when there is no snapshot. A malformed file is an error."""
        if not self.path.is_file():
            return []
        try:
            data: Any = json.loads(self.path.read_text())
            entries = [SnapshotEntry(**e) for e in data["models"]]
        except (ValueError, KeyError, TypeError) as exc:
            raise ValueError(f"snapshot {self.path} is malformed ({exc}); move it away to "
                             "start without it") from None
        return entries
