"""Server configuration, declared once (`ServerConfig`, a msgspec Struct with its bounds);
defaults < YAML file < PAGEDSERVE_* environment < CLI.

Every key of `config/server-config.yaml` is a field of `ServerConfig`. Unknown keys in the file
are errors naming the key (a typo never falls back silently to a default); the environment is
read only for known keys (`PAGEDSERVE_<KEY>` upper-cased, parsed by the field's declared type),
since other PAGEDSERVE_* variables belong to the engine (cache folders, kernel switches).
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from pathlib import Path
from typing import Annotated, Any

import msgspec
import yaml
from msgspec import Meta

from pagedserve.engine.config.schema import SchemaError, check_fields, convert
from pagedserve.server.common.auth import KEY_PATTERN

ENV_PREFIX = "PAGEDSERVE_"
MAX_CONFIG_BYTES = 1 << 20
_TRUE, _FALSE = ("1", "true", "yes", "on"), ("0", "false", "no", "off", "")
_NULL = ("", "none", "null")

SECRET_KEYS = frozenset({"inference_key", "management_key"})  # never echoed in an error
_Positive = Annotated[int, Meta(ge=1)]
_Path = Annotated[str, Meta(min_length=1)]


class ServerConfigError(ValueError):
    """A server setting that cannot be used; the message names where it came from and the key."""


def parse_address(value: str) -> tuple[str, int]:
    """ "HOST:PORT" (or "http://HOST:PORT", TorchServe's form) -> (host, port)."""
    text = str(value).strip().removeprefix("http://")
    host, sep, port = text.rpartition(":")
    if not sep or not host or not port.isdigit() or not 0 <= int(port) <= 65535:
        raise ValueError(f"{value!r} is not HOST:PORT")
    return host.strip("[]"), int(port)


class _ServerFields(msgspec.Struct, forbid_unknown_fields=True, kw_only=True):
    """The declaration: every setting's type, bound and default."""

    inference_address: str = "127.0.0.1:8080"
    management_address: str = "127.0.0.1:8081"
    metrics_address: str = "127.0.0.1:8082"
    model_store: _Path = "model_store"
    # Archives registered at start: "NAME=ARCHIVE", "ARCHIVE" (name from the manifest), "all"
    # (every archive in the store) or "default" (the bundled model, archived into the store).
    load_models: list[str] = []
    enable_model_api: bool = False
    disable_token_auth: bool = False
    key_file: _Path = "key_file.json"
    # Keys given instead of generated (pagedserve.server.common.auth.KEY_PATTERN); PAGEDSERVE_INFERENCE_KEY etc.
    inference_key: Annotated[str, Meta(pattern=KEY_PATTERN)] | None = None
    management_key: Annotated[str, Meta(pattern=KEY_PATTERN)] | None = None
    keep_key_file: bool = False  # reuse the keys of an existing key_file (a key given above wins)
    health_needs_token: bool = False  # /ping, /live, /ready and /v2/health/* need the inference key
    # The console's sign-in link printed at start carries the keys; None: when stdout is a terminal.
    console_link_keys: bool | None = None
    # Regular expressions a registration URL must match in full; empty: files inside the store.
    allowed_urls: list[str] = []
    default_workers_per_model: _Positive | None = None  # None: the archive's minWorkers
    job_queue_size: _Positive = 100  # per model version, unless its model-config sets jobQueueSize
    max_request_size: _Positive = 6_553_500  # bytes (TorchServe's default)
    max_response_size: _Positive = 6_553_500
    frontend_threads: _Positive = 4  # thread pool for tokenization and archive work
    worker_threads: _Positive | None = None  # torch threads per worker; None: cores / total workers
    drain_grace: Annotated[float, Meta(ge=0)] = 30.0  # seconds SIGTERM waits for in-flight requests
    # Seconds a worker may stay silent (it sends a heartbeat every second while idle, its outputs
    # every step while busy) before it counts as stalled: killed and restarted.
    worker_heartbeat_timeout: Annotated[float, Meta(ge=2, le=86_400)] = 30.0
    snapshot_path: _Path | None = "snapshot.json"  # None: no snapshots
    restore_snapshot: bool = True
    allow_custom_handlers: bool = False
    allow_insecure: bool = False  # start with auth off on a non-loopback address
    # Connection limits per port (pagedserve.server.serving.connections): seconds to deliver a request's headers,
    # seconds to deliver its body after them, open connections.
    header_read_timeout: Annotated[float, Meta(gt=0, le=86400)] = 30.0
    body_read_timeout: Annotated[float, Meta(gt=0, le=86400)] = 120.0
    max_connections: _Positive = 512
    # One client address's share (pagedserve.server.serving.connections, pagedserve.server.serving.state.Drain): open connections
    # per port, and requests being answered; beyond either, 429 with Retry-After. Behind a
    # proxy every client has the proxy's address: raise these (or set them to max_connections).
    max_connections_per_client: _Positive = 256
    max_in_flight_per_client: _Positive = 128
    kv_offload: dict[str, Any] | None = None  # passed through to the engine's EngineConfig when set
    vllm_metrics: bool = False  # add vLLM's `vllm:` metric names (pagedserve.server.metrics.vllm)
    # Memory all workers may take together (pagedserve.server.workers.memory_budget): a size ("12GiB", bytes);
    # None: 75 % of the machine's memory (of the GPU's on a GPU).
    memory_budget: int | str | None = None
    # Seconds a version with minWorkers 0 stays loaded after its last request (negative: forever),
    # unless its model-config says keepAlive or a request says keep_alive.
    keep_alive: Annotated[float, Meta(ge=-1, le=86_400)] = 300.0


class ServerConfig(_ServerFields, kw_only=True):
    """Everything `pagedserve serve` needs besides the archives themselves."""

    def __post_init__(self) -> None:
        try:
            check_fields(self, _ServerFields)
        except SchemaError as exc:
            raise ServerConfigError(str(exc)) from None
        for key in ("inference_address", "management_address", "metrics_address"):
            try:
                parse_address(getattr(self, key))
            except ValueError as exc:
                raise ServerConfigError(f"{key}: {exc}") from None

    @property
    def model_store_path(self) -> Path:
        return Path(self.model_store).expanduser().absolute()

    def replace(self, **changes: Any) -> ServerConfig:
        return msgspec.structs.replace(self, **changes)


FIELDS = {f.name: f for f in msgspec.structs.fields(ServerConfig)}


def load_server_config(
    path: str | Path | None = None, env: Mapping[str, str] | None = None, overrides: Mapping[str, Any] | None = None
) -> ServerConfig:
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
    return _convert(values)


def _convert(values: Mapping[str, Any]) -> ServerConfig:
    try:
        return convert(dict(values), ServerConfig)
    except SchemaError as exc:
        raise ServerConfigError(str(exc)) from None


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
            raise ServerConfigError(f"{path}: unknown key {key!r}; allowed keys: {', '.join(FIELDS)}")
    try:
        _convert(data)
    except ServerConfigError as exc:
        raise ServerConfigError(f"{path}: {exc}") from None
    return dict(data)


def read_env(env: Mapping[str, str]) -> dict[str, Any]:
    """Known keys from PAGEDSERVE_<KEY>, read by the field's declared type: lists are
    comma-separated, booleans true/false/yes/no/on/off/1/0, null/none/"" for an optional value."""
    values: dict[str, Any] = {}
    for key, info in FIELDS.items():
        name = ENV_PREFIX + key.upper()
        if name in env:
            value = _parse_env(info.type, env[name].strip())
            try:
                convert({key: value}, _ServerFields, strict=False)
            except SchemaError as exc:
                shown = "<not shown>" if key in SECRET_KEYS else repr(env[name])
                raise ServerConfigError(f"{name}={shown}: {exc}") from None
            values[key] = msgspec.convert(value, info.type, strict=False)
    return values


def _parse_env(declared: Any, text: str) -> Any:
    """Text -> the shape of the declared type; the bounds are checked by the caller."""
    kinds = _kinds(msgspec.inspect.type_info(declared))
    if "null" in kinds and text.lower() in _NULL:
        return None
    if "list" in kinds:
        return [part.strip() for part in text.split(",") if part.strip()]
    if "bool" in kinds and text.lower() in _TRUE + _FALSE:
        return text.lower() in _TRUE
    if "dict" in kinds:
        return yaml.safe_load(text)
    return text


def _kinds(info: msgspec.inspect.Type) -> set[str]:
    if isinstance(info, msgspec.inspect.UnionType):
        return set().union(*(_kinds(t) for t in info.types))
    return {
        {
            msgspec.inspect.NoneType: "null",
            msgspec.inspect.ListType: "list",
            msgspec.inspect.BoolType: "bool",
            msgspec.inspect.DictType: "dict",
        }.get(type(info), "other")
    }
