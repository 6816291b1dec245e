"""The built-in `llm` handler: JSON request bodies -> engine requests -> JSON response bodies.

A body holds `prompt` (text or token ids) or `messages` (a chat, rendered with the model's chat
template), plus sampling fields named as in `SamplingParams` (OpenAI/vLLM names). Unknown fields,
wrong types and invalid values are refused per request with a 400-style error; the other
requests of the batch still run.

The three steps split where the server needs them:
- `preprocess` only checks bodies (raw request -> `ParsedBody`): no model, no tokenizer;
- `inference` is the in-process path: it tokenizes, checks lengths and generates with an
  offline `LLM`, built by `initialize` unless the context says the server's engine workers do
  inference (`system_properties["engine"] == "workers"`);
- `postprocess` turns each finished `RequestOutput` into the /predictions reply.
The server runs a custom handler's `preprocess` and `postprocess` around its workers (see
handlers.custom_handler); for the built-in handler it calls the same parsing and shaping code
(`handlers.llm_input`, `handlers.llm_output`) directly.
"""

from __future__ import annotations

from typing import Any

from engine import LLM
from engine.outputs import RequestOutput
from engine.request import Request
from handlers.base_handler import BaseHandler, Context, HandlerError
from handlers.llm_input import (
    LLMInput,
    ParsedBody,
    check_fits,
    decode_body,
    parse_predictions_body,
    render_prompt,
)
from handlers.llm_output import prediction_response

ENGINE_WORKERS = "workers"  # system_properties["engine"] when the server's workers generate


class LLMHandler(BaseHandler):
    def __init__(self) -> None:
        super().__init__()
        self.llm: LLM | None = None

    def initialize(self, context: Context) -> None:
        if context.system_properties.get("engine") != ENGINE_WORKERS:
            self.llm = LLM(context.model_dir, **context.model_config.engine_options())
        super().initialize(context)

    # -- preprocess ------------------------------------------------------------------------
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

    # -- inference (in-process) ------------------------------------------------------------
    def inference(self, inputs: list[ParsedBody | HandlerError]) -> list[RequestOutput | HandlerError]:
        if self.llm is None:
            raise RuntimeError("this handler was initialized for the server's engine workers, "
                               "which do its inference")
        ready = [self._prepare(x) if isinstance(x, ParsedBody) else x for x in inputs]
        valid = [x for x in ready if isinstance(x, LLMInput)]
        outputs = iter(
            self.llm.generate([x.token_ids for x in valid], [x.params for x in valid]) if valid else []
        )
        results: list[RequestOutput | HandlerError] = []
        for x in ready:
            if isinstance(x, HandlerError):
                results.append(x)
            else:
                out = next(outputs)
                out.prompt = x.prompt
                results.append(out)
        return results

    def _prepare(self, parsed: ParsedBody) -> LLMInput | HandlerError:
        try:
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

    # -- postprocess -----------------------------------------------------------------------
    def postprocess(self, outputs: list[RequestOutput | HandlerError]) -> list[dict[str, Any]]:
        return [
            out.to_response() if isinstance(out, HandlerError) else prediction_response(self.context.model_name, out)
            for out in outputs
        ]
