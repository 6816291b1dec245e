"""The one error a handler raises for a request it refuses (every surface maps it to its own
error shape: TorchServe's, OpenAI's, KServe's, ...)."""

from __future__ import annotations

from typing import Any

from pagedserve.engine.request.inputs import InvalidInput


class HandlerError(ValueError):
    """A request the handler refuses; `code` is the HTTP status the server should answer."""

    def __init__(self, message: str, code: int = 400, param: str | None = None) -> None:
        super().__init__(message)
        self.code = code
        self.param = param  # the request field at fault, when one is (OpenAI's error `param`)

    @classmethod
    def from_invalid_input(cls, exc: InvalidInput) -> HandlerError:
        """The engine's refusal of a prepared request, as a 400 naming the field."""
        return cls(str(exc), 400, param=exc.field)

    def to_response(self) -> dict[str, Any]:
        kind = "BadRequest" if self.code == 400 else "InternalServerError"
        return {"code": self.code, "type": kind, "message": str(self)}
