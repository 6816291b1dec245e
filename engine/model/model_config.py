"""model-config.yaml: TorchServe-style per-model settings, validated when an archive is opened.

The top level holds the frontend keys that apply to pagedserve (workers, timeouts, device,
parallelism, queue size); the `handler:` mapping holds engine options, named exactly as the
fields of `EngineConfig`, plus `options:`, a free-form mapping for the archive's own (custom)
handler. Unknown keys are errors, so a typo never silently falls back to a default.
`config/model-config.yaml` documents every key with its default.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml

from engine.config import EngineConfig

MAX_CONFIG_BYTES = 1 << 20  # a model-config.yaml is a few lines; refuse to parse a huge one
_PLACEHOLDER_MODEL = "<model-config>"


class ModelConfigError(ValueError):
    """A model-config.yaml that cannot be used; the message names the file, the key and why."""


class DeviceType(str, enum.Enum):
    CPU = "cpu"
    GPU = "gpu"


class ParallelType(str, enum.Enum):
    """TorchServe's values; pagedserve runs one device per worker, so only the level matters yet."""

    PP = "pp"
    TP = "tp"
    PPTP = "pptp"
    CUSTOM = "custom"


# Frontend keys (TorchServe's camelCase names) -> dataclass field names.
_FRONTEND_KEYS = {
    "minWorkers": "min_workers",
    "maxWorkers": "max_workers",
    "responseTimeout": "response_timeout",
    "startupTimeout": "startup_timeout",
    "deviceType": "device_type",
    "parallelType": "parallel_type",
    "parallelLevel": "parallel_level",
    "jobQueueSize": "job_queue_size",
}
FRONTEND_KEYS = tuple(_FRONTEND_KEYS)
_POSITIVE_INT_KEYS = ("minWorkers", "maxWorkers", "responseTimeout", "startupTimeout",
                      "parallelLevel", "jobQueueSize")


class _T(enum.Enum):
    """Accepted YAML types of a handler option (bool is never accepted as an int)."""

    INT = "an integer"
    OPT_INT = "an integer or null"
    BOOL = "true or false"
    STR = "a string"
    SIZE = "a byte count or a size string such as 2GiB"
    OPT_MAPPING = "a mapping of keys or null"


HANDLER_OPTIONS_KEY = "options"  # handler.options: settings for a custom handler, not the engine

# Engine options allowed under `handler:` (EngineConfig fields; `model` and `device` are not
# per-archive settings: the archive is the model and deviceType picks the device).
HANDLER_KEYS: dict[str, _T] = {
    "dtype": _T.STR,
    "max_model_len": _T.OPT_INT,
    "block_size": _T.INT,
    "kv_cache_memory": _T.SIZE,
    "num_kv_blocks": _T.OPT_INT,
    "max_num_seqs": _T.INT,
    "max_num_batched_tokens": _T.INT,
    "enable_prefix_caching": _T.BOOL,
    "prefix_cache_hash": _T.STR,
    "scheduling_policy": _T.STR,
    "seed": _T.INT,
    "attention_backend": _T.STR,
    "num_threads": _T.OPT_INT,
    # {cpu_size_gb, disk_path, disk_size_gb, chunk_size}: engine.kv_offload.config
    "kv_offload": _T.OPT_MAPPING,
    # {method: ngram, num_speculative_tokens, prompt_lookup_max, prompt_lookup_min}: engine.spec_decode.config
    "speculative": _T.OPT_MAPPING,
}


@dataclass(slots=True)
class ModelConfig:
    """A parsed model-config.yaml; `handler` holds only the engine options the file sets."""

    min_workers: int = 1
    max_workers: int = 1
    response_timeout: int = 120  # seconds
    startup_timeout: int = 120  # seconds
    device_type: DeviceType | None = None  # None: the server's default device
    parallel_type: ParallelType | None = None
    parallel_level: int = 1
    job_queue_size: int = 100
    handler: dict[str, Any] = field(default_factory=dict)
    source: str = "model-config.yaml"  # the file name used in error messages

    def __post_init__(self) -> None:
        for key in _POSITIVE_INT_KEYS:
            _check_positive_int(self.source, key, getattr(self, _FRONTEND_KEYS[key]))
        self.device_type = _coerce(self.source, "deviceType", DeviceType, self.device_type)
        self.parallel_type = _coerce(self.source, "parallelType", ParallelType, self.parallel_type)
        if self.min_workers > self.max_workers:
            raise ModelConfigError(f"{self.source}: minWorkers={self.min_workers}: must not exceed "
                                   f"maxWorkers={self.max_workers}")
        _check_handler(self.source, self.handler)

    @classmethod
    def from_dict(cls, data: Any, source: str = "model-config.yaml") -> ModelConfig:
        """Build from the parsed YAML document (None, i.e. an empty file, means all defaults)."""
        if data is None:
            data = {}
        if not isinstance(data, dict):
            raise ModelConfigError(f"{source}: the top level must be a mapping of keys, "
                                   f"got {type(data).__name__}")
        allowed = [*_FRONTEND_KEYS, "handler"]
        kwargs: dict[str, Any] = {}
        for key, value in data.items():
            if key == "handler":
                if value is None:
                    value = {}
                if not isinstance(value, dict):
                    raise ModelConfigError(f"{source}: handler: must be a mapping of engine "
                                           f"options, got {type(value).__name__}")
                kwargs["handler"] = dict(value)
            elif key in _FRONTEND_KEYS:
                kwargs[_FRONTEND_KEYS[key]] = value
            else:
                raise ModelConfigError(f"{source}: unknown key {key!r}; allowed keys: "
                                       f"{', '.join(allowed)}")
        return cls(**kwargs, source=source)

    def engine_options(self) -> dict[str, Any]:
        """The handler's engine options, as keyword arguments for `EngineConfig` / `LLM`."""
        return {k: v for k, v in self.handler.items() if k != HANDLER_OPTIONS_KEY}

    @property
    def handler_options(self) -> dict[str, Any]:
        """`handler.options`: free-form settings a custom handler reads in `initialize`."""
        return dict(self.handler.get(HANDLER_OPTIONS_KEY) or {})

    def resolved(self) -> dict[str, Any]:
        """Every setting with defaults filled in (engine options as EngineConfig resolves them),
        JSON-serialisable, keyed as in the YAML file."""
        out: dict[str, Any] = {}
        for key, name in _FRONTEND_KEYS.items():
            value = getattr(self, name)
            out[key] = value.value if isinstance(value, enum.Enum) else value
        engine = EngineConfig(model=_PLACEHOLDER_MODEL, **self.engine_options())
        handler = {}
        for key in HANDLER_KEYS:
            value = getattr(engine, key)
            handler[key] = value.value if isinstance(value, enum.Enum) else value
        handler[HANDLER_OPTIONS_KEY] = self.handler_options
        out["handler"] = handler
        return out


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


def _check_positive_int(source: str, key: str, value: Any) -> None:
    if not isinstance(value, int) or isinstance(value, bool) or value < 1:
        raise ModelConfigError(f"{source}: {key}={value!r}: must be a positive integer")


def _coerce(source: str, key: str, enum_cls: type[enum.Enum], value: Any) -> Any:
    if value is None or isinstance(value, enum_cls):
        return value
    try:
        return enum_cls(value)
    except ValueError:
        allowed = ", ".join(repr(m.value) for m in enum_cls)
        raise ModelConfigError(f"{source}: {key}={value!r}: choose one of {allowed}") from None


def _check_handler(source: str, options: dict[str, Any]) -> None:
    """Check each option's type, then its value by building an EngineConfig with it alone (so
    the error names the key), then all together. `options` is the custom handler's business."""
    options = dict(options)
    custom = options.pop(HANDLER_OPTIONS_KEY, None)
    if not _has_type(_T.OPT_MAPPING, custom):
        raise ModelConfigError(f"{source}: handler.{HANDLER_OPTIONS_KEY}={custom!r}: must be "
                               f"{_T.OPT_MAPPING.value} (settings for a custom handler)")
    for key, value in options.items():
        kind = HANDLER_KEYS.get(key) if isinstance(key, str) else None
        if kind is None:
            raise ModelConfigError(f"{source}: unknown key handler.{key}; allowed keys: "
                                   f"{', '.join([*HANDLER_KEYS, HANDLER_OPTIONS_KEY])}")
        if not _has_type(kind, value):
            raise ModelConfigError(f"{source}: handler.{key}={value!r}: must be {kind.value}")
        if kind in (_T.INT, _T.OPT_INT) and value is not None and value < (0 if key == "seed" else 1):
            what = "a non-negative integer" if key == "seed" else "a positive integer"
            raise ModelConfigError(f"{source}: handler.{key}={value!r}: must be {what}")
        try:
            EngineConfig(model=_PLACEHOLDER_MODEL, **{key: value})
        except ValueError as exc:
            if str(exc).startswith((f"{key}.", f"{key}:")):  # already names the nested key
                raise ModelConfigError(f"{source}: handler.{exc}") from None
            raise ModelConfigError(f"{source}: handler.{key}={value!r}: "
                                   f"{_strip_key(str(exc), key, value)}") from None
    try:
        EngineConfig(model=_PLACEHOLDER_MODEL, **options)
    except ValueError as exc:
        raise ModelConfigError(f"{source}: handler: {exc}") from None


def _has_type(kind: _T, value: Any) -> bool:
    is_int = isinstance(value, int) and not isinstance(value, bool)
    if kind is _T.INT:
        return is_int
    if kind is _T.OPT_INT:
        return value is None or is_int
    if kind is _T.BOOL:
        return isinstance(value, bool)
    if kind is _T.STR:
        return isinstance(value, str)
    if kind is _T.OPT_MAPPING:
        return value is None or isinstance(value, dict)
    return is_int or isinstance(value, str)  # _T.SIZE


def _strip_key(message: str, key: str, value: Any) -> str:
    """EngineConfig's messages often start with the key, which the caller already names."""
    for prefix in (f"{key}={value!r}: ", f"{key} "):
        if message.startswith(prefix):
            return message[len(prefix):]
    return message
