"""Snapshots of the registered models, so registrations survive a restart.

The file holds, per model version: name, version, archive URL, min/max workers, whether it
is the default version, its lifecycle state (loaded, sleeping or unloaded) and whether it is
pinned (one `SnapshotEntry`; the last two default to "loaded" and unpinned, as in files
written before they existed), and the chat template a .gguf file or model folder was registered
with, if any; and per LoRA adapter its name and archive URL (`AdapterEntry`,
restored after the models, onto its base version). The registry saves it before each change takes
effect (`pagedserve.server.common.safe_write`: an O_EXCL|O_NOFOLLOW temporary file, fsync, rename, fsync of the
folder), and a failed save undoes the change (`pagedserve.server.workers.registry.SaveFailedError`). It is read
back at start. An entry that could not be restored — malformed (a wrong type, a missing key, a
bad name), its archive gone or unreadable — is logged as an error and carried over, exactly as
it was written, into every later save, so that a start loses no registration: fix the entry or
the archive and restart. Starting once with `--ncs` (no restore) drops what is not registered.
"""

from __future__ import annotations

import json
import logging
from pathlib import Path
from typing import TYPE_CHECKING, Annotated, Any, Literal

import msgspec

from pagedserve.server.common.safe_write import write_atomically
from pagedserve.server.workers.lifecycle import state_of
from pagedserve.server.workers.params import MAX_WORKERS
from pagedserve.server.workers.rules import MAX_NAME_LENGTH, NAME_PATTERN, VERSION_PATTERN

if TYPE_CHECKING:
    from pagedserve.server.workers.adapters import AdapterRegistry
    from pagedserve.server.workers.registry import ModelRegistry

logger = logging.getLogger(__name__)
FORMAT = 1
MAX_SNAPSHOT_BYTES = 64 << 20

Name = Annotated[str, msgspec.Meta(pattern=NAME_PATTERN, max_length=MAX_NAME_LENGTH)]
Version = Annotated[str, msgspec.Meta(pattern=VERSION_PATTERN, max_length=MAX_NAME_LENGTH)]
Workers = Annotated[int, msgspec.Meta(ge=0, le=MAX_WORKERS)]


class SnapshotEntry(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    """One registered model version as the snapshot keeps it."""

    name: Name
    version: Version
    url: Annotated[str, msgspec.Meta(min_length=1)]
    min_workers: Workers
    max_workers: Workers
    default: bool
    state: Literal["loaded", "sleeping", "unloaded"] = "loaded"
    pinned: bool = False
    # The chat template given when a .gguf file or model folder was registered (written only when set).
    chat_template: Annotated[str, msgspec.Meta(min_length=1, max_length=65536)] | None = None


def entries_of(registry: ModelRegistry) -> list[SnapshotEntry]:
    out = []
    for model in registry.sorted_models():
        for version in sorted(model.versions):
            v = model.versions[version]
            out.append(
                SnapshotEntry(
                    v.name,
                    v.version,
                    v.url,
                    v.min_workers,
                    v.max_workers,
                    version == model.default_version,
                    _saved_state(v),
                    v.pinned,
                    v.archive.chat_template,
                )
            )
    return out


def _saved_state(v: Any) -> Literal["loaded", "sleeping", "unloaded"]:
    """What a restart should bring back: a version loading now counts as loaded."""
    state = state_of(v)
    return "loaded" if state == "loading" else state


def _key(raw: Any) -> tuple[Any, Any] | None:
    """(name, version) of a raw entry, when it has them."""
    return (raw.get("name"), raw.get("version")) if isinstance(raw, dict) else None


class AdapterEntry(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    """One registered LoRA adapter as the snapshot keeps it (its base is in its manifest)."""

    name: Name
    url: Annotated[str, msgspec.Meta(min_length=1)]


class Snapshotter:
    """Writes the registry's snapshot to `path` when its content changed."""

    def __init__(self, path: str | Path) -> None:
        self.path = Path(path).expanduser().absolute()
        # Entries not restored at this start, as read (JSON values), kept for the next start.
        self.carried: list[Any] = []
        self.carried_adapters: list[Any] = []
        self.adapters: AdapterRegistry | None = None  # the registered adapters, saved too
        self.adapter_entries: list[AdapterEntry] = []  # read by load(), restored after the models
        self._last: str | None = None

    def carry(self, entry: SnapshotEntry) -> None:
        """Keep an entry that could not be restored in every later save."""
        self.carried.append(msgspec.to_builtins(entry))

    def save(self, registry: ModelRegistry) -> None:
        """Write the registry's entries (and the carried ones not registered again). OSError,
        naming the file, when it cannot be written; the file is then unchanged."""
        entries: list[Any] = msgspec.to_builtins(entries_of(registry))
        for e in entries:
            if e["chat_template"] is None:
                del e["chat_template"]
        registered = {_key(e) for e in entries}
        entries += [e for e in self.carried if _key(e) is None or _key(e) not in registered]
        adapters: list[Any] = [
            {"name": a.name, "url": a.url} for a in (self.adapters.sorted() if self.adapters else [])
        ]
        names = {a["name"] for a in adapters}
        adapters += [a for a in self.carried_adapters if not isinstance(a, dict) or a.get("name") not in names]
        text = json.dumps({"format": FORMAT, "models": entries, "adapters": adapters}, indent=2) + "\n"
        if text == self._last:
            return
        try:
            write_atomically(self.path, text.encode())
        except OSError as exc:
            raise OSError(exc.errno, f"could not save the snapshot {self.path}: {exc.strerror or exc}") from exc
        self._last = text

    def load(self) -> list[SnapshotEntry]:
        """The saved entries; [] when there is no snapshot. A malformed entry is logged and
        carried (not returned); a file that is not a snapshot at all is a ValueError."""
        if not self.path.is_file():
            return []
        try:
            with open(self.path, "rb") as f:
                raw = f.read(MAX_SNAPSHOT_BYTES + 1)
            if len(raw) > MAX_SNAPSHOT_BYTES:
                raise ValueError(f"larger than {MAX_SNAPSHOT_BYTES} bytes")
            data: Any = json.loads(raw)
            models = data.get("models") if isinstance(data, dict) else None
            if not isinstance(models, list):
                raise ValueError("no 'models' list")
        except (OSError, ValueError, RecursionError) as exc:
            raise ValueError(f"snapshot {self.path} is malformed ({exc}); move it away to start without it") from None
        self._load_adapters(data.get("adapters", []))
        entries = []
        for i, item in enumerate(models):
            try:
                entries.append(msgspec.convert(item, SnapshotEntry))
            except msgspec.ValidationError as exc:
                shown = json.dumps(item)
                shown = shown if len(shown) <= 200 else shown[:197] + "..."
                logger.error(
                    "snapshot %s: entry %d is malformed (%s): %s; skipped, and kept "
                    "in the snapshot: correct or remove it",
                    self.path,
                    i,
                    exc,
                    shown,
                )
                self.carried.append(item)
        return entries

    def _load_adapters(self, items: Any) -> None:
        """Read the adapters' entries into `adapter_entries` (a malformed one is carried)."""
        self.adapter_entries = []
        for item in items if isinstance(items, list) else []:
            try:
                self.adapter_entries.append(msgspec.convert(item, AdapterEntry))
            except msgspec.ValidationError as exc:
                logger.error(
                    "snapshot %s: adapter entry %s is malformed (%s); kept in the snapshot: correct or remove it",
                    self.path,
                    json.dumps(item)[:200],
                    exc,
                )
                self.carried_adapters.append(item)

    def carry_adapter(self, entry: AdapterEntry) -> None:
        """Keep an adapter that could not be restored in every later save."""
        self.carried_adapters.append(msgspec.to_builtins(entry))
