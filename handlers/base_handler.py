"""The handler contract, TorchServe's reduced to what runs around an LLM engine:
`initialize(context)` once, then per batch `preprocess` (raw requests -> what to generate) and
`postprocess` (finished outputs -> reply bodies). Generating in between is not the handler's:
the server's engine workers do it (with streaming, timeouts and aborts), or, without a server,
an offline `LLM` through `pagedserve.handlers.llm_handler.handle_batch`."""

from __future__ import annotations

import abc
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from pagedserve.engine.model.model_config import ModelConfig
from pagedserve.handlers.errors import HandlerError

if TYPE_CHECKING:
    from pagedserve.engine.request.outputs import RequestOutput
    from pagedserve.handlers.llm_input import ParsedBody

__all__ = ["BaseHandler", "Context", "HandlerError"]


@dataclass(slots=True)
class Context:
    """What a handler learns about its model when a worker starts it."""

    model_name: str
    model_dir: Path  # the verified model directory (an opened archive's root)
    manifest: dict[str, Any] = field(default_factory=dict)
    model_config: ModelConfig = field(default_factory=ModelConfig)
    system_properties: dict[str, Any] = field(default_factory=dict)  # e.g. {"device": "cpu"}


class BaseHandler(abc.ABC):
    """One instance per model version (the server shares it between the version's workers)."""

    def __init__(self) -> None:
        self.initialized = False
        self.context: Context | None = None

    def initialize(self, context: Context) -> None:
        self.context = context
        self.initialized = True

    @abc.abstractmethod
    def preprocess(self, requests: list[dict[str, Any]]) -> list[ParsedBody | HandlerError]:
        """One `ParsedBody` (or a HandlerError in its place) per raw request (`{"body": ...,
        "headers": {...}}`)."""

    @abc.abstractmethod
    def postprocess(self, outputs: list[RequestOutput]) -> list[Any]:
        """One reply body per finished output."""
