"""The built-in `llm` handler: JSON request bodies -> engine requests -> JSON response bodies.

A body holds `prompt` (text or token ids) or `messages` (a chat, rendered with the model's chat
template), plus sampling fields named as in `SamplingParams` (OpenAI/vLLM names). Unknown fields,
wrong types and invalid values are refused per request with a 400-style error; the other
requests of the batch still run.
"""

from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass
from typing import Any

from engine import LLM, SamplingParams
from engine.outputs import RequestOutput
from engine.request import Request
from handlers.base_handler import BaseHandler, Context, HandlerError

SAMPLING_FIELDS = frozenset(f.name for f in dataclasses.fields(SamplingParams))
PROMPT_FIELDS = frozenset({"prompt", "messages"})
# Accepted and ignored: routing and transport fields the server or the client sets.
IGNORED_FIELDS = frozenset({"model", "stream"})


@dataclass(slots=True)
class LLMInput:
    prompt: str | None
    token_ids: list[int]
    params: SamplingParams


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
            body = _decode_body(request.get("body", request.get("data")))
            unknown = set(body) - SAMPLING_FIELDS - PROMPT_FIELDS - IGNORED_FIELDS
            if unknown:
                raise HandlerError(f"unknown field(s) {sorted(unknown)}")
            if ("prompt" in body) == ("messages" in body):
                raise HandlerError("give exactly one of 'prompt' or 'messages'")
            params = SamplingParams(**{k: v for k, v in body.items() if k in SAMPLING_FIELDS})
            prompt, token_ids = self._tokenize(body)
            # Same checks the engine applies (length, token ids), before anything is queued.
            self.llm.engine.validate_request(Request("check", token_ids, params))
            return LLMInput(prompt, token_ids, params)
        except HandlerError as exc:
            return exc
        except (ValueError, TypeError) as exc:
            return HandlerError(str(exc))

    def _tokenize(self, body: dict[str, Any]) -> tuple[str | None, list[int]]:
        tokenizer = self.llm.tokenizer
        if "messages" in body:
            messages = body["messages"]
            if not isinstance(messages, list) or not messages or not all(
                isinstance(m, dict) and isinstance(m.get("role"), str) and isinstance(m.get("content"), str)
                for m in messages
            ):
                raise HandlerError("'messages' must be a non-empty list of {role, content} strings")
            text = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
            return text, tokenizer.encode(text, add_special_tokens=False)
        prompt = body["prompt"]
        if isinstance(prompt, str):
            return prompt, tokenizer.encode(prompt, add_special_tokens=False)
        if isinstance(prompt, list) and all(isinstance(t, int) and not isinstance(t, bool) for t in prompt):
            return None, list(prompt)
        raise HandlerError("'prompt' must be a string or a list of token ids")

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
        return [out.to_response() if isinstance(out, HandlerError) else self._response(out) for out in outputs]

    def _response(self, out: RequestOutput) -> dict[str, Any]:
        completion_tokens = sum(len(c.token_ids) for c in out.outputs)
        return {
            "model": self.context.model_name,
            "choices": [
                {
                    "index": c.index,
                    "text": c.text,
                    "token_ids": c.token_ids,
                    "finish_reason": c.finish_reason,
                    "stop_reason": c.stop_reason,
                    "logprobs": None if c.logprobs is None else [
                        {str(tok): {"logprob": lp.logprob, "rank": lp.rank, "token": lp.decoded_token}
                         for tok, lp in entry.items()}
                        for entry in c.logprobs
                    ],
                }
                for c in out.outputs
            ],
            "usage": {
                "prompt_tokens": len(out.prompt_token_ids),
                "completion_tokens": completion_tokens,
                "total_tokens": len(out.prompt_token_ids) + completion_tokens,
                "cached_prompt_tokens": out.num_cached_tokens,
            },
        }


def _decode_body(raw: Any) -> dict[str, Any]:
    if isinstance(raw, (bytes, bytearray)):
        try:
            raw = raw.decode("utf-8")
        except UnicodeDecodeError:
            raise HandlerError("the request body is not UTF-8") from None
    if isinstance(raw, str):
        try:
            raw = json.loads(raw)
        except json.JSONDecodeError as exc:
            raise HandlerError(f"the request body is not valid JSON: {exc}") from None
    if not isinstance(raw, dict):
        raise HandlerError("the request body must be a JSON object")
    return raw
