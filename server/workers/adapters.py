"""Registered LoRA adapters: each attached to a base model version's workers (no process of its own).

Registering an adapter archive (pagedserve.engine.model.lora_archive) checks, off the event loop, that its base
model version is registered, that the base's weights hash to what the adapter's manifest pinned
(else the adapter was trained for other weights: refused, 400), and that its factors fit the
base (ranks within the base's `max_lora_rank`, shapes, supported options). Requests naming the
adapter as their model go to the base version's workers with the adapter's `LoRARequest`; each
worker reads the adapter's folder the first time it sees it (a restarted worker too).

Unregistering removes the name at once (new requests get 404) and then waits for the requests
already in flight under it to finish.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
from collections.abc import Iterator
from dataclasses import dataclass, field
from datetime import datetime, timezone
from typing import Any

from pagedserve.engine.lora.adapter import load_adapter, lora_shapes
from pagedserve.engine.lora.request import LoRARequest
from pagedserve.engine.model.lora_archive import model_dir_digest
from pagedserve.server.workers.archives import LoadedArchive
from pagedserve.server.workers.registry import ModelRegistry
from pagedserve.server.workers.rules import ConflictError, check_model_name
from pagedserve.server.workers.version import ModelVersion

DEFAULT_MAX_LORA_RANK = 16  # EngineConfig's default


def is_adapter(archive: LoadedArchive) -> bool:
    return "lora" in archive.manifest["model"]


@dataclass(slots=True, eq=False)
class RegisteredAdapter:
    name: str
    version: str
    url: str
    archive: LoadedArchive
    base: ModelVersion
    lora: LoRARequest
    rank: int
    registered_at: datetime = field(default_factory=lambda: datetime.now(timezone.utc))
    in_flight: int = 0
    _idle: asyncio.Event = field(default_factory=asyncio.Event)

    @contextlib.contextmanager
    def track(self) -> Iterator[None]:
        """Count a request running under this adapter (unregistering waits for them)."""
        self.in_flight += 1
        self._idle.clear()
        try:
            yield
        finally:
            self.in_flight -= 1
            if self.in_flight == 0:
                self._idle.set()

    async def wait_idle(self) -> None:
        if self.in_flight:
            await self._idle.wait()

    def describe(self) -> dict[str, Any]:
        record = self.archive.manifest["model"]["lora"]
        return {
            "modelName": self.name,
            "modelVersion": self.version,
            "modelUrl": self.url,
            "adapter": True,
            "parent": self.base.name,
            "parentVersion": self.base.version,
            "rank": self.rank,
            "targetModules": record.get("targetModules"),
            "baseWeightsSha256": record["baseWeightsSha256"],
            "registeredAt": self.registered_at.isoformat(),
            "inFlight": self.in_flight,
        }


class AdapterRegistry:
    """Adapters by name. Names share one space with models: neither may shadow the other."""

    def __init__(self) -> None:
        self.adapters: dict[str, RegisteredAdapter] = {}

    def get(self, name: str) -> RegisteredAdapter | None:
        return self.adapters.get(name)

    def sorted(self) -> list[RegisteredAdapter]:
        return [self.adapters[n] for n in sorted(self.adapters)]

    async def register(
        self, registry: ModelRegistry, archive: LoadedArchive, url: str, name: str | None = None
    ) -> RegisteredAdapter:
        record = archive.manifest["model"]["lora"]
        name = check_model_name(name or archive.name)
        if name in self.adapters or name in registry.models:
            raise ConflictError(f"Model {name} is already registered.")
        base = registry.resolve(record["baseModel"], record.get("baseVersion"))  # 404 if absent
        loop = asyncio.get_running_loop()
        rank = await loop.run_in_executor(None, _check_against_base, archive, base, name)
        if name in self.adapters or name in registry.models:  # registered meanwhile
            raise ConflictError(f"Model {name} is already registered.")
        adapter = RegisteredAdapter(
            name, archive.version, url, archive, base, LoRARequest(name, str(archive.model_dir)), rank
        )
        self.adapters[name] = adapter
        return adapter

    async def unregister(self, name: str) -> RegisteredAdapter:
        """Remove the adapter now (new requests: 404), then wait for its requests in flight."""
        adapter = self.adapters.pop(name)
        await adapter.wait_idle()
        return adapter

    def attached_to(self, base: ModelVersion) -> list[RegisteredAdapter]:
        return [a for a in self.sorted() if a.base is base]


def _check_against_base(archive: LoadedArchive, base: ModelVersion, name: str) -> int:
    """ValueError unless the adapter was made for the base's weights and fits its engine; the rank."""
    record = archive.manifest["model"]["lora"]
    digest = model_dir_digest(base.model_dir, base.archive.manifest)
    if digest != record["baseWeightsSha256"]:
        raise ValueError(
            f"adapter {name!r} was made for other weights than model {base.name!r} version "
            f"{base.version} (base weights sha256 {digest[:16]}..., the adapter's manifest pins "
            f"{record['baseWeightsSha256'][:16]}...): refused"
        )
    from pagedserve.engine.model.registry import parse_config  # the model families import torch: only here

    spec = parse_config(json.loads((base.model_dir / "config.json").read_text()))
    max_rank = int(base.model_config.handler.get("max_lora_rank", DEFAULT_MAX_LORA_RANK))
    return load_adapter(name, archive.model_dir, lora_shapes(spec), max_rank).rank
