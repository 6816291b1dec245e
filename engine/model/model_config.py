"""model-config.yaml: TorchServe-style per-model settings, validated when an archive is opened.

The top level holds the frontend keys that apply to pagedserve (workers, timeouts, device,
parallelism, queue size), declared once in `ModelConfigFile` (TorchServe's camelCase names, with
their bounds); the `handler:` mapping holds engine options, derived from the fields of
`EngineConfig` (their names, types and bounds: a new EngineConfig field is a new key), plus
`options:`, a free-form mapping for the archive's own (custom) handler. Unknown keys are errors,
so a typo never silently falls back to a default. `config/model-config.yaml` documents every key
with its default.
"""

from __future__ import annotations

import enum
import logging
import typing
from pathlib import Path
from typing import Annotated, Any

import msgspec
import yaml
from msgspec import Meta

from pagedserve.engine.config.engine import EngineConfig, EngineFields
from pagedserve.engine.config.schema import SchemaError, convert
from pagedserve.engine.model import vllm_config

logger = logging.getLogger(__name__)
MAX_CONFIG_BYTES = 1 << 20  # a model-config.yaml is a few lines; refuse to parse a huge one
MAX_WORKERS = 64
MAX_TIMEOUT_S = 86_400
_PLACEHOLDER_MODEL = "<model-config>"
HANDLER_OPTIONS_KEY = "options"  # handler.options: settings for a custom handler, not the engine
# EngineConfig fields that are not per-archive settings: the archive is the model, deviceType
# picks the device, and the server says whether it verified the archive.
_NOT_HANDLER_KEYS = frozenset({"model", "device", "visible_devices", "model_verified"})


class ModelConfigError(ValueError):
    """A model-config.yaml that cannot be used; the message names the file, the key and why."""


class DeviceType(str, enum.Enum):
    CPU = "cpu"
    GPU = "gpu"


class ParallelType(str, enum.Enum):
    """TorchServe's values. pagedserve runs tensor parallelism: `tp` with `parallelLevel: N` is
    `handler.tensor_parallel_size: N`; `custom` leaves it to the handler (TorchServe's vLLM
    example sets tensor_parallel_size under vllm_engine_config); pp and pptp are refused."""

    PP = "pp"
    TP = "tp"
    PPTP = "pptp"
    CUSTOM = "custom"


DEFAULT_MAX_TOKENS = 1024
WorkerRole = typing.Literal["prefill", "decode", "both"]
_Workers = Annotated[int, Meta(ge=1, le=MAX_WORKERS)]
_Seconds = Annotated[int, Meta(ge=1, le=MAX_TIMEOUT_S)]


class ModelConfigFile(msgspec.Struct, forbid_unknown_fields=True, rename="camel"):
    """The declaration of the file's frontend keys (field min_workers is key minWorkers)."""

    min_workers: Annotated[int, Meta(ge=0, le=MAX_WORKERS)] = 1  # 0: loaded on demand
    max_workers: _Workers = 1
    response_timeout: _Seconds = 120  # seconds
    startup_timeout: _Seconds = 120  # seconds
    device_type: str | None = None  # a DeviceType; None: the server's default device
    # GPUs (indexes as the server sees them) the workers share round-robin; None: every visible
    # one (server/workers/devices.py).
    device_ids: list[Annotated[int, Meta(ge=0, le=1023)]] | None = None
    parallel_type: str | None = None  # a ParallelType
    parallel_level: Annotated[int, Meta(ge=1, le=MAX_WORKERS)] = 1
    job_queue_size: Annotated[int, Meta(ge=1, le=1 << 20)] = 100
    # How /v1/chat/completions reads tool calls the model wrote (pagedserve.handlers.openai_tools).
    tool_parser: typing.Literal["hermes", "llama3_json", "mistral", "pythonic"] = "hermes"
    # Seconds a version with minWorkers 0 stays loaded after its last request (negative:
    # forever); None: the server's keep_alive.
    keep_alive: Annotated[float, Meta(ge=-1, le=MAX_TIMEOUT_S)] | None = None
    # How the front end picks among the version's workers (pagedserve.server.workers.routing).
    routing: typing.Literal["least_loaded", "prefix_affinity"] = "least_loaded"
    # One role per worker slot, in order (slots past the list are `both`): `prefill` workers only
    # compute prompts and hand their KV to a `decode` worker through the KV offload connector
    # (pagedserve.server.workers.disagg); None: every worker does both.
    worker_roles: Annotated[list[WorkerRole], Meta(min_length=1, max_length=MAX_WORKERS)] | None = None
    # Output tokens of a request that names no limit (capped by the context left after its prompt).
    default_max_tokens: Annotated[int, Meta(ge=1, le=1 << 20)] = DEFAULT_MAX_TOKENS
    handler: dict[str, Any] | None = None


# Frontend keys (TorchServe's camelCase names) -> field names.
_FRONTEND_KEYS = {f.encode_name: f.name for f in msgspec.structs.fields(ModelConfigFile) if f.name != "handler"}
FRONTEND_KEYS = tuple(_FRONTEND_KEYS)


def _handler_keys() -> dict[str, Any]:
    return {f.name: f.type for f in msgspec.structs.fields(EngineFields) if f.name not in _NOT_HANDLER_KEYS}


# Engine options allowed under `handler:`, with the type each takes in the file.
HANDLER_KEYS: dict[str, Any] = _handler_keys()
HandlerSection = msgspec.defstruct(
    "HandlerSection",
    [(key, kind, None) for key, kind in HANDLER_KEYS.items()] + [(HANDLER_OPTIONS_KEY, dict[str, Any] | None, None)],
    forbid_unknown_fields=True,
)


class ModelConfig(msgspec.Struct, kw_only=True):
    """A parsed model-config.yaml; `handler` holds only the engine options the file sets. Its
    values are checked against `ModelConfigFile` (the declaration) when built; `__post_init__`
    adds only the rules between keys."""

    min_workers: int = 1
    max_workers: int = 1
    response_timeout: int = 120  # seconds
    startup_timeout: int = 120  # seconds
    device_type: DeviceType | None = None  # None: the server's default device
    device_ids: list[int] | None = None  # GPUs the workers share; None: all visible
    parallel_type: ParallelType | None = None
    parallel_level: int = 1
    job_queue_size: int = 100
    tool_parser: str = "hermes"  # hermes, llama3_json, mistral or pythonic
    keep_alive: float | None = None  # seconds; None: the server's keep_alive
    routing: str = "least_loaded"  # least_loaded or prefix_affinity
    worker_roles: list[str] | None = None  # per worker slot: prefill, decode or both
    default_max_tokens: int = DEFAULT_MAX_TOKENS  # a request without a token limit
    handler: dict[str, Any] = msgspec.field(default_factory=dict)
    source: str = "model-config.yaml"  # the file name used in error messages

    def __post_init__(self) -> None:
        values = {key: _plain(getattr(self, name)) for key, name in _FRONTEND_KEYS.items()}
        try:
            convert({**values, "handler": self.handler}, ModelConfigFile)
        except SchemaError as exc:
            raise ModelConfigError(f"{self.source}: {exc}") from None
        self.device_type = _coerce(self.source, "deviceType", DeviceType, self.device_type)
        self.parallel_type = _coerce(self.source, "parallelType", ParallelType, self.parallel_type)
        if self.min_workers > self.max_workers:
            raise ModelConfigError(
                f"{self.source}: minWorkers: must not exceed maxWorkers ({self.max_workers}), got {self.min_workers}"
            )
        _check_handler(self.source, self.handler)
        self._check_parallel()
        try:
            check_worker_roles(self.worker_roles, "workerRoles")
        except ValueError as exc:
            raise ModelConfigError(f"{self.source}: {exc}") from None

    def _check_parallel(self) -> None:
        """parallelType/parallelLevel against what runs: tensor parallelism, with the handler's
        other options (some are refused with it)."""
        kind, level = self.parallel_type, self.parallel_level
        if level > 1 and kind in (None, ParallelType.PP, ParallelType.PPTP):
            named = "unset" if kind is None else kind.value
            raise ModelConfigError(
                f"{self.source}: parallelType: {named} with parallelLevel {level} is not "
                "supported; pagedserve runs tensor parallelism (parallelType: tp)"
            )
        handler_size = self.handler.get("tensor_parallel_size")
        if kind is ParallelType.TP and handler_size is not None and handler_size != level:
            raise ModelConfigError(
                f"{self.source}: handler.tensor_parallel_size: {handler_size} contradicts "
                f"parallelLevel: {level} with parallelType: tp; set one of them"
            )
        if kind is ParallelType.TP and level > 1:
            try:
                EngineConfig(model=_PLACEHOLDER_MODEL, **self.engine_options())
            except ValueError as exc:
                raise ModelConfigError(f"{self.source}: parallelLevel: {exc}") from None

    @classmethod
    def from_dict(cls, data: Any, source: str = "model-config.yaml") -> ModelConfig:
        """Build from the parsed YAML document (None, i.e. an empty file, means all defaults)."""
        if data is None:
            data = {}
        if not isinstance(data, dict):
            raise ModelConfigError(f"{source}: the top level must be a mapping of keys, got {type(data).__name__}")
        try:  # a config written for TorchServe's vllm_handler: its keys read as ours
            data, warnings = vllm_config.translate(data, source)
        except ValueError as exc:
            raise ModelConfigError(str(exc)) from None
        for warning in warnings:
            logger.warning("%s", warning)
        for key in data:
            if key != "handler" and key not in _FRONTEND_KEYS:
                raise ModelConfigError(
                    f"{source}: unknown key {key!r}; allowed keys: {', '.join([*_FRONTEND_KEYS, 'handler'])}"
                )
        kwargs = {_FRONTEND_KEYS[k]: v for k, v in data.items() if k != "handler"}
        handler = data.get("handler")
        if handler is not None and not isinstance(handler, dict):
            raise ModelConfigError(
                f"{source}: handler: must be a mapping of engine options, got {type(handler).__name__}"
            )
        return cls(**kwargs, handler=dict(handler or {}), source=source)

    def engine_options(self) -> dict[str, Any]:
        """The handler's engine options, as keyword arguments for `EngineConfig` / `LLM`
        (`parallelType: tp` makes parallelLevel the tensor_parallel_size)."""
        options = {k: v for k, v in self.handler.items() if k != HANDLER_OPTIONS_KEY}
        if self.parallel_type is ParallelType.TP and self.parallel_level > 1:
            options["tensor_parallel_size"] = self.parallel_level
        return options

    @property
    def handler_options(self) -> dict[str, Any]:
        """`handler.options`: free-form settings a custom handler reads in `initialize`."""
        return dict(self.handler.get(HANDLER_OPTIONS_KEY) or {})

    def resolved(self) -> dict[str, Any]:
        """Every setting with defaults filled in (engine options as EngineConfig resolves them),
        JSON-serialisable, keyed as in the YAML file."""
        out: dict[str, Any] = {key: _plain(getattr(self, name)) for key, name in _FRONTEND_KEYS.items()}
        engine = EngineConfig(model=_PLACEHOLDER_MODEL, **self.engine_options())
        handler = msgspec.to_builtins({key: getattr(engine, key) for key in HANDLER_KEYS})
        handler[HANDLER_OPTIONS_KEY] = self.handler_options
        out["handler"] = handler
        return out


def check_worker_roles(roles: list[str] | None, key: str) -> None:
    """The rule between roles: a prefill worker hands its requests to a decode (or both) worker,
    so it never comes alone. ValueError naming `key`."""
    if roles and "prefill" in roles and not ({"decode", "both"} & set(roles)):
        raise ValueError(f"{key}: must list a decode or both worker beside the prefill ones, got {roles}")


def load_model_config(path: str | Path) -> ModelConfig:
    """Parse and validate the model-config.yaml at `path` (raises `ModelConfigError`)."""
    path = Path(path)
    source = path.name
    with open(path, "rb") as f:
        raw = f.read(MAX_CONFIG_BYTES + 1)
    if len(raw) > MAX_CONFIG_BYTES:
        raise ModelConfigError(f"{source}: larger than {MAX_CONFIG_BYTES} bytes")
    try:
        data = yaml.safe_load(raw.decode("utf-8"))
    except UnicodeDecodeError:
        raise ModelConfigError(f"{source}: not UTF-8 text") from None
    except yaml.YAMLError as exc:
        raise ModelConfigError(f"{source}: not valid YAML ({exc})") from None
    return ModelConfig.from_dict(data, source=source)


def _plain(value: Any) -> Any:
    return value.value if isinstance(value, enum.Enum) else value


def _coerce(source: str, key: str, enum_cls: type[enum.Enum], value: Any) -> Any:
    if value is None or isinstance(value, enum_cls):
        return value
    try:
        return enum_cls(value)
    except ValueError:
        allowed = ", ".join(repr(m.value) for m in enum_cls)
        raise ModelConfigError(f"{source}: {key}: choose one of {allowed}, got {value!r}") from None


def _check_handler(source: str, options: dict[str, Any]) -> None:
    """Check the options' types and bounds against the declaration derived from EngineConfig,
    then each value by building an EngineConfig with it alone (so the error names the key),
    then all together. `options` is the custom handler's business."""
    unknown = [key for key in options if key not in HANDLER_KEYS and key != HANDLER_OPTIONS_KEY]
    if unknown:
        raise ModelConfigError(
            f"{source}: unknown key handler.{unknown[0]}; allowed keys: "
            f"{', '.join([*HANDLER_KEYS, HANDLER_OPTIONS_KEY])}"
        )
    try:
        convert(options, HandlerSection)
    except SchemaError as exc:
        raise ModelConfigError(f"{source}: handler.{exc}") from None
    engine_options = {k: v for k, v in options.items() if k != HANDLER_OPTIONS_KEY}
    for key, value in engine_options.items():
        try:
            EngineConfig(model=_PLACEHOLDER_MODEL, **{key: value})
        except ValueError as exc:
            if str(exc).startswith(f"{key}."):  # already names the nested key
                raise ModelConfigError(f"{source}: handler.{exc}") from None
            raise ModelConfigError(f"{source}: handler.{key}: {_strip_key(str(exc), key, value)}") from None
    try:
        EngineConfig(model=_PLACEHOLDER_MODEL, **engine_options)
    except ValueError as exc:
        raise ModelConfigError(f"{source}: handler: {exc}") from None


def _strip_key(message: str, key: str, value: Any) -> str:
    """EngineConfig's messages often start with the key, which the caller already names."""
    for prefix in (f"{key}={value!r}: ", f"{key}: ", f"{key} "):
        if message.startswith(prefix):
            return message[len(prefix) :]
    return message
