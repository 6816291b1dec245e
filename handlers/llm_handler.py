"""The built-in `llm` handler: JSON request bodies -> what to generate -> JSON reply bodies.

A body holds `prompt` (text or token ids) or `messages` (a chat, rendered with the model's chat
template), plus sampling fields named as in `SamplingParams` (OpenAI/vLLM names). Unknown fields,
wrong types and invalid values are refused per request with a 400-style error; the other
requests of the batch still run.

- `preprocess` only checks bodies (raw request -> `ParsedBody`): no model, no tokenizer;
- `postprocess` turns each finished `RequestOutput` into the /predictions reply.
Generating in between is the server's workers' (or, in-process, `handle_batch` with an offline
`LLM`). The server's built-in /predictions route calls the same parsing and shaping code
(`pagedserve.handlers.llm_input`, `pagedserve.handlers.llm_output`); a custom handler, usually a subclass of this
one, is called around the workers (see pagedserve.handlers.custom_handler).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from pagedserve.engine.request.inputs import InvalidInput
from pagedserve.engine.request.outputs import RequestOutput
from pagedserve.handlers.base_handler import BaseHandler, HandlerError
from pagedserve.handlers.llm_input import ParsedBody, decode_body, parse_predictions_body
from pagedserve.handlers.llm_output import prediction_response

if TYPE_CHECKING:
    from pagedserve.engine.llm import LLM

# system_properties["engine"] in the Context the server gives its handlers: its engine workers
# generate (a custom handler may read it; nothing here depends on it).
ENGINE_WORKERS = "workers"


class LLMHandler(BaseHandler):
    def preprocess(self, requests: list[dict[str, Any]]) -> list[ParsedBody | HandlerError]:
        return [self.parse(request) for request in requests]

    def parse(self, request: dict[str, Any]) -> ParsedBody | HandlerError:
        """One TorchServe-style request (`body` or `data`) -> its checked body."""
        try:
            return parse_predictions_body(decode_body(request.get("body", request.get("data"))))
        except HandlerError as exc:
            return exc
        except (ValueError, TypeError) as exc:
            return HandlerError(str(exc))

    def postprocess(self, outputs: list[RequestOutput]) -> list[dict[str, Any]]:
        return [prediction_response(self.context.model_name, out) for out in outputs]


def handle_batch(handler: BaseHandler, llm: LLM, requests: list[dict[str, Any]]) -> list[Any]:
    """TorchServe's `handle` without a server: preprocess, prepare and generate with an offline
    `LLM`, postprocess. A refused request gets its error body in place; the others still run."""
    results: list[Any] = []
    for parsed in handler.preprocess(requests):
        try:
            if isinstance(parsed, HandlerError):
                raise parsed
            if not isinstance(parsed, ParsedBody):
                raise HandlerError(
                    f"preprocess must return a ParsedBody per request, got {type(parsed).__name__}", code=500
                )
            if parsed.stream:
                raise HandlerError("'stream' needs the server; the in-process handler answers whole", param="stream")
            results.append(llm.prepare(parsed.prompt, parsed.params))
        except InvalidInput as exc:
            results.append(HandlerError.from_invalid_input(exc))
        except HandlerError as exc:
            results.append(exc)
    valid = [r for r in results if not isinstance(r, HandlerError)]
    replies = iter(handler.postprocess(llm.run(valid)) if valid else [])
    return [r.to_response() if isinstance(r, HandlerError) else next(replies) for r in results]
