"""Server configuration: one dataclass; defaults < YAML file < PAGEDSERVE_* environment < CLI.

Every key of `config/server-config.yaml` is a field of `ServerConfig`. Unknown keys in the file
are errors naming the key (a typo never falls back silently to a default); the environment is
read only for known keys (`PAGEDSERVE_<KEY>` upper-cased), since other PAGEDSERVE_* variables
belong to the engine (cache folders, kernel switches).
"""

from __future__ import annotations

import dataclasses
import os
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml

ENV_PREFIX = "PAGEDSERVE_"
MAX_CONFIG_BYTES = 1 << 20


class ServerConfigError(ValueError):
    """A server setting that cannot be used; the message names where it came from and the key."""


def parse_address(value: str) -> tuple[str, int]:
    """"HOST:PORT" (or "http://HOST:PORT", TorchServe's form) -> (host, port)."""
    text = str(value).strip().removeprefix("http://")
    host, sep, port = text.rpartition(":")
    if not sep or not host or not port.isdigit() or not 0 <= int(port) <= 65535:
        raise ValueError(f"{value!r} is not HOST:PORT")
    return host.strip("[]"), int(port)


@dataclass(slots=True)
class ServerConfig:
    """Everything `pagedserve serve` needs besides the archives themselves."""

    inference_address: str = "127.0.0.1:8080"
    management_address: str = "127.0.0.1:8081"
    metrics_address: str = "127.0.0.1:8082"
    model_store: str = "model_store"
    # Archives registered at start: "NAME=ARCHIVE", "ARCHIVE" (name from the manifest), "all"
    # (every archive in the store) or "default" (the bundled model, archived into the store).
    load_models: list[str] = field(default_factory=list)
    enable_model_api: bool = False
    disable_token_auth: bool = False
    key_file: str = "key_file.json"
    # Regular expressions a registration URL must match in full; empty: files inside the store.
    allowed_urls: list[str] = field(default_factory=list)
    default_workers_per_model: int | None = None  # None: the archive's minWorkers
    job_queue_size: int = 100  # per model version, unless its model-config sets jobQueueSize
    max_request_size: int = 6_553_500  # bytes (TorchServe's default)
    max_response_size: int = 6_553_500
    frontend_threads: int = 4  # thread pool for tokenization and archive work
    worker_threads: int | None = None  # torch threads per worker; None: cores / total workers
    drain_grace: float = 30.0  # seconds SIGTERM waits for in-flight requests before aborting
    # A worker silent this long (no step output, no idle heartbeat) is stalled: restarted.
    worker_heartbeat_timeout: float = 30.0
    snapshot_path: str | None = "snapshot.json"  # None: no snapshots
    restore_snapshot: bool = True
    allow_custom_handlers: bool = False
    kv_offload: Any = None  # passed through to the engine's EngineConfig when set

    def __post_init__(self) -> None:
        for key in ("inference_address", "management_address", "metrics_address"):
            try:
                parse_address(getattr(self, key))
            except ValueError as exc:
                raise ServerConfigError(f"{key}: {exc}") from None
        for key in ("job_queue_size", "max_request_size", "max_response_size", "frontend_threads"):
            _check_int(key, getattr(self, key), optional=False)
        for key in ("default_workers_per_model", "worker_threads"):
            _check_int(key, getattr(self, key), optional=True)
        if isinstance(self.drain_grace, bool) or not isinstance(self.drain_grace, (int, float)) \
                or self.drain_grace < 0:
            raise ServerConfigError(f"drain_grace={self.drain_grace!r}: must be a number of "
                                    "seconds >= 0")
        timeout = self.worker_heartbeat_timeout
        if isinstance(timeout, bool) or not isinstance(timeout, (int, float)) \
                or not 2 <= timeout <= 86_400:
            raise ServerConfigError(f"worker_heartbeat_timeout={timeout!r}: must be a number of "
                                    "seconds from 2 to 86400 (workers send one every second)")
        for key in ("load_models", "allowed_urls"):
            value = getattr(self, key)
            if not isinstance(value, list) or not all(isinstance(v, str) for v in value):
                raise ServerConfigError(f"{key}={value!r}: must be a list of strings")
        for key in ("enable_model_api", "disable_token_auth", "allow_custom_handlers",
                    "restore_snapshot"):
            if not isinstance(getattr(self, key), bool):
                raise ServerConfigError(f"{key}={getattr(self, key)!r}: must be true or false")
        for key in ("model_store", "key_file"):
            if not isinstance(getattr(self, key), str) or not getattr(self, key):
                raise ServerConfigError(f"{key}={getattr(self, key)!r}: must be a path")
        if self.snapshot_path is not None and not isinstance(self.snapshot_path, str):
            raise ServerConfigError(f"snapshot_path={self.snapshot_path!r}: must be a path or null")

    @property
    def model_store_path(self) -> Path:
        return Path(self.model_store).expanduser().absolute()

    def replace(self, **changes: Any) -> ServerConfig:
        return dataclasses.replace(self, **changes)


FIELDS = {f.name: f for f in dataclasses.fields(ServerConfig)}
_LIST_KEYS = ("load_models", "allowed_urls")
_BOOL_KEYS = ("enable_model_api", "disable_token_auth", "allow_custom_handlers", "restore_snapshot")
_INT_KEYS = ("default_workers_per_model", "job_queue_size", "max_request_size",
             "max_response_size", "frontend_threads", "worker_threads")


def load_server_config(path: str | Path | None = None, env: Mapping[str, str] | None = None,
                       overrides: Mapping[str, Any] | None = None) -> ServerConfig:
    """Defaults, then the YAML file at `path`, then `env` (os.environ by default), then
    `overrides` (the CLI flags that were given). Raises `ServerConfigError` naming the key."""
    values: dict[str, Any] = {}
    if path is not None:
        values.update(read_config_file(path))
    values.update(read_env(os.environ if env is None else env))
    for key, value in (overrides or {}).items():
        if key not in FIELDS:
            raise ServerConfigError(f"unknown setting {key!r}")
        values[key] = value
    return ServerConfig(**values)


def read_config_file(path: str | Path) -> dict[str, Any]:
    path = Path(path).expanduser()
    try:
        with open(path, "rb") as f:
            raw = f.read(MAX_CONFIG_BYTES + 1)
    except OSError as exc:
        raise ServerConfigError(f"{path}: cannot read the config file ({exc.strerror})") from None
    if len(raw) > MAX_CONFIG_BYTES:
        raise ServerConfigError(f"{path}: larger than {MAX_CONFIG_BYTES} bytes")
    try:
        data = yaml.safe_load(raw.decode("utf-8"))
    except (UnicodeDecodeError, yaml.YAMLError) as exc:
        raise ServerConfigError(f"{path}: not valid YAML ({exc})") from None
    if data is None:
        return {}
    if not isinstance(data, dict):
        raise ServerConfigError(f"{path}: the top level must be a mapping of keys")
    for key in data:
        if key not in FIELDS:
            raise ServerConfigError(f"{path}: unknown key {key!r}; allowed keys: "
                                    f"{', '.join(FIELDS)}")
    try:
        ServerConfig(**data)
    except ServerConfigError as exc:
        raise ServerConfigError(f"{path}: {exc}") from None
    return dict(data)


def read_env(env: Mapping[str, str]) -> dict[str, Any]:
    """Known keys from PAGEDSERVE_<KEY>; lists are comma-separated, booleans true/false/1/0."""
    values: dict[str, Any] = {}
    for key in FIELDS:
        name = ENV_PREFIX + key.upper()
        if name in env:
            values[key] = _parse_env(name, key, env[name])
    return values


def _parse_env(name: str, key: str, text: str) -> Any:
    text = text.strip()
    if key in _LIST_KEYS:
        return [part.strip() for part in text.split(",") if part.strip()]
    if key in _BOOL_KEYS:
        lowered = text.lower()
        if lowered in ("1", "true", "yes", "on"):
            return True
        if lowered in ("0", "false", "no", "off", ""):
            return False
        raise ServerConfigError(f"{name}={text!r}: must be true or false")
    if key in _INT_KEYS:
        if key in ("default_workers_per_model", "worker_threads") and text.lower() in ("", "none", "null"):
            return None
        try:
            return int(text)
        except ValueError:
            raise ServerConfigError(f"{name}={text!r}: must be an integer") from None
    if key in ("drain_grace", "worker_heartbeat_timeout"):
        try:
            return float(text)
        except ValueError:
            raise ServerConfigError(f"{name}={text!r}: must be a number of seconds") from None
    if key == "snapshot_path" and text.lower() in ("", "none", "null"):
        return None
    if key == "kv_offload":
        return yaml.safe_load(text)
    return text


def _check_int(key: str, value: Any, *, optional: bool) -> None:
    if optional and value is None:
        return
    if not isinstance(value, int) or isinstance(value, bool) or value < 1:
        what = "a positive integer or null" if optional else "a positive integer"
        raise ServerConfigError(f"{key}={value!r}: must be {what}")
