"""The management API's parameters, one Struct per call, declared once with their bounds.

Query strings and JSON bodies are converted alike (`strict=False` reads "3" and "true" from a
query string); an empty value means "not given"; unknown parameters are refused. A refusal is a
`SchemaError` (400 in the management app) naming the parameter: "timeout: must be <= 86400,
got 99999999".
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

import msgspec
from msgspec import Meta

from pagedserve.engine.config.schema import SchemaError, convert
from pagedserve.engine.model.model_config import check_worker_roles

MAX_WORKERS = 64  # per model version
MAX_TIMEOUT_S = 86_400  # one day: response_timeout at registration, scale/unregister timeouts
MAX_PAGE = 1000  # models per page of GET /models
RUNTIMES = ("python", "python3")
ROLES = ("prefill", "decode", "both")
_Workers = Annotated[int, Meta(ge=0, le=MAX_WORKERS)]
_Seconds = Annotated[int, Meta(ge=1, le=MAX_TIMEOUT_S)]


class RegisterParams(msgspec.Struct, forbid_unknown_fields=True):
    """POST /models (query string or JSON body)."""

    url: Annotated[str, Meta(min_length=1, max_length=4096)]
    model_name: Annotated[str, Meta(min_length=1)] | None = (
        None  # checked by pagedserve.server.workers.rules.check_model_name
    )
    initial_workers: _Workers | None = None
    synchronous: bool = False
    response_timeout: _Seconds | None = None
    startup_timeout: _Seconds | None = None  # overrides the archive's startupTimeout
    batch_size: Annotated[int, Meta(ge=1)] = 1
    max_batch_delay: Annotated[int, Meta(ge=0, le=MAX_TIMEOUT_S * 1000)] | None = None  # accepted, unused
    runtime: str | None = None  # "python" (or "python3") only
    handler: Annotated[str, Meta(min_length=1, max_length=256)] | None = None  # the archive's own only
    # A chat template (jinja text) for a model registered from a .gguf file or a model folder
    # that has none (a base model); it becomes the built archive's chat_template.jinja.
    chat_template: Annotated[str, Meta(min_length=1, max_length=65536)] | None = None
    # One role per worker slot (prefill, decode or both), comma-separated in a query string;
    # overrides the archive's workerRoles (pagedserve.server.workers.disagg).
    worker_roles: Annotated[str, Meta(max_length=1024)] | list[str] | None = None

    def __post_init__(self) -> None:
        if self.batch_size != 1:
            raise SchemaError(
                "batch_size: pagedserve batches continuously inside the engine; only "
                f"batch_size=1 is accepted, got {self.batch_size}",
                "batch_size",
            )
        if self.runtime is not None and self.runtime not in RUNTIMES:
            raise SchemaError(
                f"runtime: pagedserve runs Python archives only ('python'), got {self.runtime!r}", "runtime"
            )
        if self.worker_roles is not None:
            self.worker_roles = _worker_roles(self.worker_roles)


def _worker_roles(value: str | list[str]) -> list[str]:
    roles = [r.strip() for r in value.split(",")] if isinstance(value, str) else list(value)
    for role in roles:
        if role not in ROLES:
            raise SchemaError(
                f"worker_roles: must be a comma-separated list of {', '.join(ROLES)}, got {role!r}", "worker_roles"
            )
    if not roles or len(roles) > MAX_WORKERS:
        raise SchemaError(f"worker_roles: must list 1 to {MAX_WORKERS} roles, got {len(roles)}", "worker_roles")
    try:
        check_worker_roles(roles, "worker_roles")
    except ValueError as exc:
        raise SchemaError(str(exc), "worker_roles") from None
    return roles


class TokenParams(msgspec.Struct, forbid_unknown_fields=True):
    """GET /token: which key to rotate."""

    type: Literal["inference", "management"]


class ScaleParams(msgspec.Struct, forbid_unknown_fields=True):
    """PUT /models/{m}[/{v}]."""

    min_worker: _Workers | None = None
    max_worker: _Workers | None = None
    synchronous: bool = False
    timeout: Annotated[int, Meta(ge=-1, le=MAX_TIMEOUT_S)] | None = None  # -1 or none: wait for ever
    number_gpu: Annotated[int, Meta(ge=0, le=MAX_WORKERS)] | None = None  # accepted, unused

    @property
    def wait_s(self) -> float | None:
        return None if self.timeout is None or self.timeout < 0 else float(self.timeout)


class UnregisterParams(msgspec.Struct, forbid_unknown_fields=True):
    """DELETE /models/{m}[/{v}] (TorchServe's parameters, accepted)."""

    synchronous: bool = False
    timeout: Annotated[int, Meta(ge=-1, le=MAX_TIMEOUT_S)] | None = None


class ListParams(msgspec.Struct, forbid_unknown_fields=True):
    """GET /models."""

    limit: Annotated[int, Meta(ge=1)] = 100  # more than MAX_PAGE gets MAX_PAGE
    next_page_token: Annotated[int, Meta(ge=0, le=(1 << 31) - 1)] = 0


def read_params(values: Any, schema: type[Any]) -> Any:
    """Query-string (or JSON body) values -> the call's Struct; "" means not given."""
    given = {k: v for k, v in dict(values).items() if v != ""}
    return convert(given, schema, strict=False)
