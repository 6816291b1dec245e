"""The handler contract, TorchServe's: initialize(context), then per batch
preprocess -> inference -> postprocess (wrapped by handle)."""

from __future__ import annotations

import abc
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from engine.model.model_config import ModelConfig


@dataclass(slots=True)
class Context:
    """What a handler learns about its model when a worker starts it."""

    model_name: str
    model_dir: Path  # the verified model directory (an opened archive's root)
    manifest: dict[str, Any] = field(default_factory=dict)
    model_config: ModelConfig = field(default_factory=ModelConfig)
    system_properties: dict[str, Any] = field(default_factory=dict)  # e.g. {"device": "cpu"}


class HandlerError(ValueError):
    """A request the handler refuses; `code` is the HTTP status the server should answer."""

    def __init__(self, message: str, code: int = 400, param: str | None = None) -> None:
        super().__init__(message)
        self.code = code
        self.param = param  # the request field at fault, when one is (OpenAI's error `param`)

    def to_response(self) -> dict[str, Any]:
        kind = "BadRequest" if self.code == 400 else "InternalServerError"
        return {"code": self.code, "type": kind, "message": str(self)}


class BaseHandler(abc.ABC):
    """One instance per worker. `handle` takes a batch of TorchServe-style requests
    (dicts with a "body" or "data" entry) and returns one response per request, in order."""

    def __init__(self) -> None:
        self.initialized = False
        self.context: Context | None = None

    def initialize(self, context: Context) -> None:
        self.context = context
        self.initialized = True

    @abc.abstractmethod
    def preprocess(self, requests: list[dict[str, Any]]) -> list[Any]:
        """Turn raw requests into model inputs (a HandlerError in place of a bad request)."""

    @abc.abstractmethod
    def inference(self, inputs: list[Any]) -> list[Any]:
        """Run the model on the valid inputs; errors pass through in place."""

    @abc.abstractmethod
    def postprocess(self, outputs: list[Any]) -> list[dict[str, Any]]:
        """Turn model outputs into response bodies."""

    def handle(self, requests: list[dict[str, Any]], context: Context) -> list[dict[str, Any]]:
        if not self.initialized:
            self.initialize(context)
        return self.postprocess(self.inference(self.preprocess(requests)))
