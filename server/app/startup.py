"""What `pagedserve serve` checks and opens before it listens: the configuration's security
(`check_secure`: no open ports without token authorization unless allowed) and the startup
models (`startup_models`: `load_models` resolved to archives in the store, the bundled model
archived there on first use)."""

from __future__ import annotations

import ipaddress
from dataclasses import dataclass
from pathlib import Path

from pagedserve.server.common.config import ServerConfig, ServerConfigError, parse_address
from pagedserve.server.workers.archives import resolve_url, store_archives

DEFAULT_ARCHIVE_NAME = "smollm2"
# The bundled model's archive, written into the store by `--models default` when absent.
DEFAULT_MODEL_CONFIG = """\
# Written by `pagedserve serve --models default` (see config/model-config.yaml for every key).
minWorkers: 1
maxWorkers: 4
handler:
  dtype: bfloat16
  kv_cache_memory: 1GiB
"""


@dataclass(frozen=True, slots=True)
class StartupModel:
    name: str | None  # None: the manifest's modelName
    url: str  # as given (relative to the store)
    path: Path


def startup_models(config: ServerConfig) -> list[StartupModel]:
    """`load_models` -> archives in the store ("all": every archive there; "default": the
    bundled model, archived into the store first when absent), or a `.gguf` file / model folder
    (archived behind the scenes), under the same location rules as POST /models."""
    store = config.model_store_path
    out: list[StartupModel] = []
    for item in config.load_models:
        given, sep, url = item.partition("=")
        name: str | None = given if sep else None
        if not sep:
            url = item
        if url == "all":
            out.extend(StartupModel(None, path.name, path.resolve()) for path in store_archives(store))
            continue
        if url == "default":
            url = ensure_default_archive(store).name
            name = name or DEFAULT_ARCHIVE_NAME
        try:
            path = resolve_url(url, store, config.allowed_urls)
        except (PermissionError, FileNotFoundError, ValueError) as exc:
            raise ServerConfigError(f"--models {item}: {exc}") from None
        out.append(StartupModel(name, url, path))
    return out


def ensure_default_archive(store: Path) -> Path:
    """`<store>/smollm2.mar`, written from the bundled model the first time."""
    dest = store / f"{DEFAULT_ARCHIVE_NAME}.mar"
    if dest.exists():
        return dest
    import tempfile

    from pagedserve.engine.model.archive import write_archive
    from pagedserve.engine.model.default_model import default_model_dir

    print(f"pagedserve: archiving the bundled model into {dest} (once)", flush=True)
    store.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(prefix="pagedserve-default-") as tmp:
        config = Path(tmp) / "model-config.yaml"
        config.write_text(DEFAULT_MODEL_CONFIG)
        return write_archive(
            default_model_dir(), store, model_name=DEFAULT_ARCHIVE_NAME, version="1.0", config_file=config
        )


def check_secure(config: ServerConfig) -> None:
    """Refuse token authorization off on a non-loopback inference or management address
    unless `allow_insecure`: anyone who reaches it could run and manage models."""
    if not config.disable_token_auth or config.allow_insecure:
        return
    exposed = [
        f"{key}={getattr(config, key)}"
        for key in ("inference_address", "management_address")
        if not _is_loopback(parse_address(getattr(config, key))[0])
    ]
    if exposed:
        raise ServerConfigError(
            f"token authorization is off (--disable-token-auth) and {', '.join(exposed)} is not a "
            "loopback address: anyone who can reach it could run and manage models. Turn "
            "authorization on, listen on 127.0.0.1, or pass --allow-insecure (allow_insecure: true)"
        )


def _is_loopback(host: str) -> bool:
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:  # a host name: it may resolve anywhere
        return False
