"""`kv_offload` settings: the mapping given in model-config.yaml (`handler: kv_offload:`) or to
`LLM(kv_offload=...)`, parsed and checked without importing LMCache.

Tiers: the engine's own block pool first, then LMCache's CPU memory (`cpu_size_gb`), then a
local disk folder (`disk_path`, at most `disk_size_gb`) that survives restarts, then a shared
Redis server (`remote_url`, `redis://host:port[/db]`) that every worker, server and machine
pointing at it reads and writes. Absent means off.
"""

from __future__ import annotations

from pathlib import Path
from typing import Annotated, Any
from urllib.parse import urlsplit

import msgspec
from msgspec import Meta

from pagedserve.engine.config.schema import SchemaError, check_fields, convert

DEFAULT_CHUNK_SIZE = 256
REMOTE_SCHEMES = ("redis", "rediss")
_GB = Annotated[float, Meta(gt=0)]


class _KVOffloadFields(msgspec.Struct, forbid_unknown_fields=True, frozen=True):
    """Offload settings. Sizes in GB (10**9 bytes, as LMCache counts them: GiB)."""

    cpu_size_gb: _GB = 1.0  # LMCache's CPU-memory tier
    disk_path: Annotated[str, Meta(min_length=1)] | None = None  # a folder; None: CPU-memory tier only
    disk_size_gb: _GB | None = None  # the disk tier's size; required with disk_path
    chunk_size: Annotated[int, Meta(ge=1)] = DEFAULT_CHUNK_SIZE  # tokens per LMCache chunk; a multiple of block_size
    # redis://host:port[/db] (rediss:// for TLS): a Redis tier shared by every worker and server using it
    remote_url: Annotated[str, Meta(pattern=r"^rediss?://")] | None = None


KEYS = tuple(f.name for f in msgspec.structs.fields(_KVOffloadFields))


class KVOffloadConfig(_KVOffloadFields, frozen=True):
    """Validated offload settings: the declaration's bounds, then the rules between keys; the
    disk folder made absolute."""

    def __post_init__(self) -> None:
        try:
            check_fields(self, _KVOffloadFields)
        except SchemaError as exc:
            raise SchemaError(f"kv_offload.{exc}", f"kv_offload.{exc.field}") from None
        if self.disk_path is not None:
            path = Path(self.disk_path).expanduser()
            if path.exists() and not path.is_dir():
                raise SchemaError(
                    f"kv_offload.disk_path: {self.disk_path!r} exists and is not a folder", "kv_offload.disk_path"
                )
            msgspec.structs.force_setattr(self, "disk_path", str(path.absolute()))
            if self.disk_size_gb is None:
                raise SchemaError(
                    "kv_offload.disk_size_gb: is required with kv_offload.disk_path", "kv_offload.disk_size_gb"
                )
        elif self.disk_size_gb is not None:
            raise SchemaError(
                "kv_offload.disk_size_gb: is set but kv_offload.disk_path is not", "kv_offload.disk_size_gb"
            )
        if self.remote_url is not None:
            _check_remote_url(self.remote_url)

    @classmethod
    def from_options(cls, options: Any, block_size: int) -> KVOffloadConfig:
        """Parse the user's mapping; the error names the key. `chunk_size` must be a multiple of
        the engine's `block_size`, since loads and stores move whole blocks."""
        if isinstance(options, KVOffloadConfig):
            config = options
        else:
            try:
                config = convert(options, cls)
            except SchemaError as exc:
                name = (
                    str(exc)
                    if str(exc).startswith("kv_offload")
                    else f"kv_offload: {exc}"
                    if exc.field is None
                    else f"kv_offload.{exc}"
                )
                raise SchemaError(name, exc.field) from None
        if config.chunk_size % block_size:
            raise SchemaError(
                f"kv_offload.chunk_size: must be a multiple of block_size={block_size}, got {config.chunk_size}",
                "kv_offload.chunk_size",
            )
        return config

    def as_dict(self) -> dict[str, Any]:
        return msgspec.structs.asdict(self)


def _check_remote_url(url: Any) -> None:
    """`redis://host:port[/db]` (or `rediss://` for TLS), with a host and a port."""
    form = "redis://host:port[/db]"
    if not isinstance(url, str):
        raise SchemaError(f"kv_offload.remote_url: {url!r} must be a URL such as {form}")
    try:
        parts = urlsplit(url)
        port = parts.port
    except ValueError:
        raise SchemaError(f"kv_offload.remote_url: {url!r} not a valid URL ({form})") from None
    if parts.scheme not in REMOTE_SCHEMES:
        raise SchemaError(
            f"kv_offload.remote_url: {url!r} the scheme must be one of {', '.join(REMOTE_SCHEMES)} ({form})"
        )
    if not parts.hostname or port is None:
        raise SchemaError(f"kv_offload.remote_url: {url!r} needs a host and a port ({form})")
    if parts.path not in ("", "/") and not parts.path[1:].isdigit():
        raise SchemaError(f"kv_offload.remote_url: {url!r} the path may only be a database number ({form})")


def merge_kv_offload(defaults: dict[str, Any] | None, model: dict[str, Any] | None) -> dict[str, Any] | None:
    """A model's `kv_offload` mapping over server-wide defaults (either may be absent).

    A model without its own mapping inherits the server's; a model mapping overrides key by key.
    """
    if model is None:
        return dict(defaults) if defaults else None
    return {**(defaults or {}), **model}
