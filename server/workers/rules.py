"""The registry's rules, checked whoever asks for a change (the management API or the snapshot
restore): names and versions follow TorchServe's characters and `MAX_NAME_LENGTH`, worker counts
stay within the version's maxWorkers, timeouts within `MAX_TIMEOUT_S`; and the errors the
registry answers with (each mapped to its HTTP status by the apps)."""

from __future__ import annotations

import re

from pagedserve.server.common.safe_write import NO_SPACE
from pagedserve.server.workers.params import MAX_TIMEOUT_S, MAX_WORKERS

MAX_NAME_LENGTH = 128  # a name must fit in a URL path, well under the 8 KiB header limit
# TorchServe's characters; a name starts with a letter, a version with a letter or digit.
# \Z, not $: "$" would accept a trailing newline.
NAME_PATTERN = r"^[A-Za-z][A-Za-z0-9_.\-]*\Z"
VERSION_PATTERN = r"^[A-Za-z0-9][A-Za-z0-9_.\-]*\Z"


class InvalidNameError(ValueError):
    """A model name or version that breaks the naming rule (400, naming the field)."""


class ModelNotFoundError(LookupError):
    """No such model or version (404); the message names it."""


class QueueFullError(RuntimeError):
    """The version's jobQueueSize is reached (503 with Retry-After)."""


class ConflictError(RuntimeError):
    """The model version is already registered (409)."""


class ForbiddenError(RuntimeError):
    """An operation TorchServe forbids, e.g. removing the default version of a model (403)."""


class SaveFailedError(RuntimeError):
    """The change could not be saved and was undone: 507 when the disk is full, else 500."""

    def __init__(self, cause: OSError) -> None:
        super().__init__(f"{cause.strerror or cause}; the change was not made")
        self.status = 507 if cause.errno in NO_SPACE else 500


def check_model_name(name: object, what: str = "model name") -> str:
    """A model name usable in URLs; ValueError naming the rule otherwise."""
    return _check_name(name, what, NAME_PATTERN, "start with a letter")


def check_version(version: object, what: str = "model version") -> str:
    return _check_name(version, what, VERSION_PATTERN, "start with a letter or digit")


def _check_name(value: object, what: str, pattern: str, start: str) -> str:
    if not isinstance(value, str) or len(value) > MAX_NAME_LENGTH or not re.match(pattern, value):
        shown = repr(value) if len(repr(value)) <= 40 else repr(value)[:37] + "..."
        raise ValueError(
            f"{what} {shown} is not allowed: it must {start}, hold only letters, "
            f"digits, '_', '-' and '.', and be at most {MAX_NAME_LENGTH} characters"
        )
    return value


def check_worker_counts(min_workers: int, max_workers: int, limit_name: str = "max_worker") -> None:
    """min <= max <= MAX_WORKERS; ValueError naming both otherwise."""
    if min_workers < 0:
        raise ValueError(f"min_worker: must be >= 0, got {min_workers}")
    if min_workers > max_workers:
        raise ValueError(f"min_worker: {min_workers} must not exceed {limit_name}: {max_workers}")
    if max_workers > MAX_WORKERS:
        raise ValueError(f"max_worker: must be <= {MAX_WORKERS} (workers per version), got {max_workers}")


def check_timeout(what: str, seconds: float | None) -> None:
    if seconds is not None and seconds > MAX_TIMEOUT_S:
        raise ValueError(f"{what}: must be <= {MAX_TIMEOUT_S} seconds, got {seconds}")
