"""The built-in `llm` handler: JSON request bodies -> engine requests -> JSON response bodies.

A body holds `prompt` (text or token ids) or `messages` (a chat, rendered with the model's chat
template), plus sampling fields named as in `SamplingParams` (OpenAI/vLLM names). Unknown fields,
wrong types and invalid values are refused per request with a 400-style error; the other
requests of the batch still run.

The parsing (`handlers.llm_input`) and the response shaping (`handlers.llm_output`) need no
engine: the server uses them with its engine workers. This class is the in-process path
(TorchServe's handler contract over an offline `LLM`).
"""

from __future__ import annotations

from typing import Any

from engine import LLM
from engine.outputs import RequestOutput
from engine.request import Request
from handlers.base_handler import BaseHandler, Context, HandlerError
from handlers.llm_input import (
    LLMInput,
    check_fits,
    decode_body,
    parse_predictions_body,
    render_prompt,
)
from handlers.llm_output import prediction_response


class LLMHandler(BaseHandler):
    def __init__(self) -> None:
        super().__init__()
        self.llm: LLM | None = None

    def initialize(self, context: Context) -> None:
        self.llm = LLM(context.model_dir, **context.model_config.engine_options())
        super().initialize(context)

    # -- preprocess ------------------------------------------------------------------------
    def preprocess(self, requests: list[dict[str, Any]]) -> list[LLMInput | HandlerError]:
        return [self._parse(request) for request in requests]

    def _parse(self, request: dict[str, Any]) -> LLMInput | HandlerError:
        try:
            parsed = parse_predictions_body(decode_body(request.get("body", request.get("data"))))
            if parsed.stream:
                raise HandlerError("'stream' needs the server; the in-process handler answers whole")
            prompt, token_ids = render_prompt(self.llm.tokenizer, parsed.prompt)
            engine = self.llm.engine
            check_fits(token_ids, parsed.params, engine.max_model_len, engine.vocab_size)
            # Same checks the engine applies, before anything is queued.
            engine.validate_request(Request("check", token_ids, parsed.params))
            return LLMInput(prompt, token_ids, parsed.params)
        except HandlerError as exc:
            return exc
        except (ValueError, TypeError) as exc:
            return HandlerError(str(exc))

    # -- inference / postprocess -----------------------------------------------------------
    def inference(self, inputs: list[LLMInput | HandlerError]) -> list[RequestOutput | HandlerError]:
        valid = [x for x in inputs if isinstance(x, LLMInput)]
        outputs = iter(
            self.llm.generate([x.token_ids for x in valid], [x.params for x in valid]) if valid else []
        )
        results: list[RequestOutput | HandlerError] = []
        for x in inputs:
            if isinstance(x, HandlerError):
                results.append(x)
            else:
                out = next(outputs)
                out.prompt = x.prompt
                results.append(out)
        return results

    def postprocess(self, outputs: list[RequestOutput | HandlerError]) -> list[dict[str, Any]]:
        return [
            out.to_response() if isinstance(out, HandlerError) else prediction_response(self.context.model_name, out)
            for out in outputs
        ]
