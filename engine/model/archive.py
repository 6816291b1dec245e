"""Model archives (TorchServe-style `.mar`): write, open safely, verify.

The pieces live in `archive_manifest` (schema, checks, handler resolution), `archive_write`
(`write_archive`) and `archive_read` (`open_archive`); this module gathers the public API.
"""

from __future__ import annotations

from pagedserve.engine.model.archive_manifest import BUILTIN_HANDLER, MANIFEST_PATH, ArchiveError, ArchiveFormat
from pagedserve.engine.model.archive_read import DEFAULT_MAX_TOTAL_BYTES, OpenedArchive, open_archive
from pagedserve.engine.model.archive_write import write_archive

__all__ = [
    "BUILTIN_HANDLER",
    "DEFAULT_MAX_TOTAL_BYTES",
    "MANIFEST_PATH",
    "ArchiveError",
    "ArchiveFormat",
    "OpenedArchive",
    "open_archive",
    "write_archive",
]
