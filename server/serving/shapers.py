"""The bodies each endpoint answers with, as `pagedserve.server.serving.generation.Shaper`s: TorchServe-style
/predictions (NDJSON when streamed), /predictions through a custom handler, and OpenAI (SSE
when streamed). The shapes themselves live in handlers/ (`llm_output`, `openai_responses`);
these adapters add where `timings` and `usage` go in a stream (on its last chunk) and what an
error looks like."""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from typing import Any

from pagedserve.engine.request.outputs import RequestOutput
from pagedserve.handlers.base_handler import BaseHandler, HandlerError
from pagedserve.handlers.deltas import ChoiceDelta
from pagedserve.handlers.llm_output import prediction_chunk, prediction_response, timings, usage
from pagedserve.handlers.openai_embeddings import EmbeddingsRequest, embeddings_response
from pagedserve.handlers.openai_responses import OpenAIFormatter
from pagedserve.server.common.errors import ERROR_TYPES, error_body
from pagedserve.server.serving.generation import ErrorReply
from pagedserve.server.serving.streaming import StreamFormat

logger = logging.getLogger(__name__)
OPENAI_ERROR_TYPES = {
    400: "invalid_request_error",
    401: "authentication_error",
    404: "invalid_request_error",
    413: "invalid_request_error",
    429: "rate_limit_error",
    503: "service_unavailable",
}


def openai_error(code: int, message: str, param: str | None = None) -> dict[str, Any]:
    """OpenAI's error body: {"error": {"message", "type", "param", "code"}}."""
    return {
        "error": {
            "message": message,
            "type": OPENAI_ERROR_TYPES.get(code, "server_error"),
            "param": param,
            "code": "model_not_found" if code == 404 else code,
        }
    }


@dataclass(slots=True)
class PredictionShaper:
    model: str
    request_id: str
    stream_format: StreamFormat = StreamFormat.NDJSON

    def whole(self, out: RequestOutput, total_s: float) -> dict[str, Any]:
        return prediction_response(self.model, out, self.request_id, total_s)

    def opening(self, n: int) -> dict[str, Any] | None:
        return None

    def chunk(self, deltas: list[ChoiceDelta]) -> dict[str, Any]:
        return prediction_chunk(self.model, self.request_id, deltas)

    def closing(self, deltas: list[ChoiceDelta], out: RequestOutput, total_s: float) -> list[dict[str, Any]]:
        last = prediction_chunk(self.model, self.request_id, deltas)
        last["usage"] = usage(out)
        last["timings"] = timings(out, total_s)
        return [last]

    def error(self, code: int, message: str) -> dict[str, Any]:
        return {"id": self.request_id, "error": error_body(code, message, ERROR_TYPES.get(code))}


@dataclass(slots=True)
class HandlerShaper(PredictionShaper):
    """/predictions through a custom handler: its `postprocess` shapes whole replies (a dict
    reply gets `timings` added unless it has its own); streamed chunks keep the built-in shape."""

    handler: BaseHandler = field(kw_only=True)

    def whole(self, out: RequestOutput, total_s: float) -> Any:
        try:
            bodies = self.handler.postprocess([out])
        except HandlerError as exc:
            raise ErrorReply.from_handler_error(exc) from None
        except Exception as exc:  # their code: answer 500 and say where
            logger.exception("the custom handler's postprocess failed")
            raise ErrorReply(500, f"the custom handler's postprocess failed: {type(exc).__name__}: {exc}") from None
        if not isinstance(bodies, list) or len(bodies) != 1:
            raise ErrorReply(
                500,
                "the custom handler's postprocess must return a list with one reply "
                f"per output, got {type(bodies).__name__}",
            )
        body = bodies[0]
        if isinstance(body, dict):
            body.setdefault("timings", timings(out, total_s))
        return body


@dataclass(slots=True)
class OpenAIShaper:
    formatter: OpenAIFormatter
    stream_format: StreamFormat = StreamFormat.SSE

    def whole(self, out: RequestOutput, total_s: float) -> dict[str, Any]:
        return self.formatter.response(out, total_s)

    def opening(self, n: int) -> dict[str, Any] | None:
        return self.formatter.first_chunk(n)

    def chunk(self, deltas: list[ChoiceDelta]) -> list[dict[str, Any]]:
        return self.formatter.delta_chunks(deltas)

    def closing(self, deltas: list[ChoiceDelta], out: RequestOutput, total_s: float) -> list[dict[str, Any]]:
        chunks = self.formatter.delta_chunks(deltas) or [self.formatter.chunk([])]
        if self.formatter.request.include_usage:
            chunks.append(self.formatter.usage_chunk(out))
        chunks[-1]["timings"] = timings(out, total_s)
        return chunks

    def error(self, code: int, message: str) -> dict[str, Any]:
        return openai_error(code, message)


@dataclass(slots=True)
class EmbeddingsShaper:
    """/v1/embeddings: answered whole only (there is nothing to stream): a `WholeShaper`."""

    request: EmbeddingsRequest
    model: str  # the name the client asked for
    stream_format: StreamFormat = StreamFormat.SSE

    def whole(self, out: RequestOutput, total_s: float) -> dict[str, Any]:
        try:
            body = embeddings_response(self.request, self.model, out)
        except HandlerError as exc:
            raise ErrorReply.from_handler_error(exc) from None
        body["timings"] = timings(out, total_s)
        return body

    def error(self, code: int, message: str) -> dict[str, Any]:
        return openai_error(code, message)
