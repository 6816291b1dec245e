"""`kv_offload` settings: the mapping given in model-config.yaml (`handler: kv_offload:`) or to
`LLM(kv_offload=...)`, parsed and checked without importing LMCache.

Tiers: the engine's own block pool first, then LMCache's CPU memory (`cpu_size_gb`), then a
local disk folder (`disk_path`, at most `disk_size_gb`) that survives restarts, then a shared
Redis server (`remote_url`, `redis://host:port[/db]`) that every worker, server and machine
pointing at it reads and writes. Absent means off.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

DEFAULT_CHUNK_SIZE = 256
KEYS = ("cpu_size_gb", "disk_path", "disk_size_gb", "chunk_size", "remote_url")
REMOTE_SCHEMES = ("redis", "rediss")


def _number(key: str, value: Any) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not value > 0:
        raise ValueError(f"kv_offload.{key}={value!r}: must be a positive number (GB)")
    return float(value)


@dataclass(slots=True, frozen=True)
class KVOffloadConfig:
    """Validated offload settings. Sizes in GB (10**9 bytes, as LMCache counts them: GiB)."""

    cpu_size_gb: float = 1.0
    disk_path: str | None = None  # None: CPU-memory tier only
    disk_size_gb: float | None = None  # required with disk_path
    chunk_size: int = DEFAULT_CHUNK_SIZE  # tokens per LMCache chunk; a multiple of block_size
    remote_url: str | None = None  # redis://host:port[/db]: a Redis tier shared by every user

    def __post_init__(self) -> None:
        object.__setattr__(self, "cpu_size_gb", _number("cpu_size_gb", self.cpu_size_gb))
        if self.disk_path is not None:
            if not isinstance(self.disk_path, str) or not self.disk_path.strip():
                raise ValueError(f"kv_offload.disk_path={self.disk_path!r}: must be a folder path")
            path = Path(self.disk_path).expanduser()
            if path.exists() and not path.is_dir():
                raise ValueError(f"kv_offload.disk_path={self.disk_path!r}: exists and is not a folder")
            object.__setattr__(self, "disk_path", str(path.absolute()))
            if self.disk_size_gb is None:
                raise ValueError("kv_offload.disk_size_gb is required with kv_offload.disk_path")
            object.__setattr__(self, "disk_size_gb", _number("disk_size_gb", self.disk_size_gb))
        elif self.disk_size_gb is not None:
            raise ValueError("kv_offload.disk_size_gb is set but kv_offload.disk_path is not")
        chunk = self.chunk_size
        if not isinstance(chunk, int) or isinstance(chunk, bool) or chunk < 1:
            raise ValueError(f"kv_offload.chunk_size={chunk!r}: must be a positive integer")
        if self.remote_url is not None:
            _check_remote_url(self.remote_url)

    @classmethod
    def from_options(cls, options: Any, block_size: int) -> KVOffloadConfig:
        """Parse the user's mapping; the error names the key. `chunk_size` must be a multiple of
        the engine's `block_size`, since loads and stores move whole blocks."""
        if isinstance(options, KVOffloadConfig):
            config = options
        else:
            if not isinstance(options, dict):
                raise ValueError(f"kv_offload must be a mapping with keys {', '.join(KEYS)}; "  # noqa: TRY004
                                 f"got {type(options).__name__}")
            unknown = [k for k in options if k not in KEYS]
            if unknown:
                raise ValueError(f"kv_offload: unknown key {unknown[0]!r}; allowed keys: {', '.join(KEYS)}")
            config = cls(**options)
        if config.chunk_size % block_size:
            raise ValueError(f"kv_offload.chunk_size={config.chunk_size}: must be a multiple of "
                             f"block_size={block_size}")
        return config

    def as_dict(self) -> dict[str, Any]:
        return asdict(self)


def _check_remote_url(url: Any) -> None:
    """`redis://host:port[/db]` (or `rediss://` for TLS), with a host and a port."""
    form = "redis://host:port[/db]"
    if not isinstance(url, str):
        raise ValueError(f"kv_offload.remote_url={url!r}: must be a URL such as {form}")
    try:
        parts = urlsplit(url)
        port = parts.port
    except ValueError:
        raise ValueError(f"kv_offload.remote_url={url!r}: not a valid URL ({form})") from None
    if parts.scheme not in REMOTE_SCHEMES:
        raise ValueError(f"kv_offload.remote_url={url!r}: the scheme must be one of "
                         f"{', '.join(REMOTE_SCHEMES)} ({form})")
    if not parts.hostname or port is None:
        raise ValueError(f"kv_offload.remote_url={url!r}: needs a host and a port ({form})")
    if parts.path not in ("", "/") and not parts.path[1:].isdigit():
        raise ValueError(f"kv_offload.remote_url={url!r}: the path may only be a database number ({form})")


def merge_kv_offload(defaults: dict[str, Any] | None, model: dict[str, Any] | None) -> dict[str, Any] | None:
    """A model's `kv_offload` mapping over server-wide defaults (either may be absent).

    A model without its own mapping inherits the server's; a model mapping overrides key by key.
    """
    if model is None:
        return dict(defaults) if defaults else None
    return {**(defaults or {}), **model}
