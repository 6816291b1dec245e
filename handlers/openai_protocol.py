"""OpenAI request bodies (`/v1/completions`, `/v1/chat/completions`) -> engine inputs.

Plain validation, field by field, with messages that name the field. Three kinds of fields:
supported ones map to `SamplingParams`; fields OpenAI accepts that change nothing here (`user`,
`store`, `metadata`, ...) are ignored; fields OpenAI accepts that this server cannot honour
(`tools`, `logit_bias`, `echo`, `suffix`, ...) are refused with a 400 that says so; anything else is an unknown field and refused, as OpenAI does. `null` means "not given".
vLLM's extra sampling fields (`top_k`, `min_p`, `repetition_penalty`, ...) are accepted, and so is
structured output: OpenAI's `response_format` (`json_object`, `json_schema`), vLLM's
`structured_outputs` and its older `guided_json` / `guided_regex` / `guided_choice` / `guided_grammar`.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass
from typing import Any

from engine.sampling_params import SamplingParams
from handlers.base_handler import HandlerError
from handlers.llm_input import (
    PromptSpec,
    check_messages,
    make_sampling_params,
    prompt_spec,
)

MAX_N = 32  # choices per request; OpenAI allows 128, a CPU worker would not thank us
MAX_LOGPROBS = 20


class Endpoint(enum.Enum):
    COMPLETIONS = "completions"
    CHAT = "chat"


@dataclass(slots=True)
class OpenAIRequest:
    """A checked OpenAI request: what to tokenize, how to sample, how to answer."""

    endpoint: Endpoint
    model: str | None  # the body's `model` (a route prefix may select the model instead)
    prompt: PromptSpec
    params: SamplingParams
    stream: bool = False
    include_usage: bool = False  # stream_options.include_usage
    logprobs: bool = False  # answer with logprobs
    top_logprobs: int = 0  # alternatives per token (completions: the `logprobs` integer)


# Sampling fields, OpenAI's and vLLM's, with the check each value gets before SamplingParams
# applies its range rules.
_NUMBER = (int, float)
_SAMPLING_TYPES: dict[str, tuple[type, ...]] = {
    "temperature": _NUMBER, "top_p": _NUMBER, "frequency_penalty": _NUMBER,
    "presence_penalty": _NUMBER, "seed": (int,), "n": (int,),
    "top_k": (int,), "min_p": _NUMBER, "repetition_penalty": _NUMBER, "min_tokens": (int,),
    "ignore_eos": (bool,), "include_stop_str_in_output": (bool,), "skip_special_tokens": (bool,),
}
# Accepted by OpenAI, no effect here.
_IGNORED = frozenset({"user", "store", "metadata", "service_tier", "parallel_tool_calls", "prompt_cache_key",
                      "safety_identifier"})
# Structured output: OpenAI's response_format, vLLM's structured_outputs and its older guided_* fields.
_GUIDED = {"guided_json": "json", "guided_regex": "regex", "guided_choice": "choice", "guided_grammar": "grammar"}
_STRUCTURED_FIELDS = frozenset({"response_format", "structured_outputs", *_GUIDED})
_COMMON = (frozenset({"model", "stream", "stream_options", "stop", "stop_token_ids", "max_tokens"})
           | set(_SAMPLING_TYPES) | _STRUCTURED_FIELDS)
_COMPLETION_FIELDS = _COMMON | {"prompt", "logprobs", "best_of", "echo", "suffix", "logit_bias"}
_CHAT_FIELDS = _COMMON | {
    "messages", "logprobs", "top_logprobs", "max_completion_tokens", "logit_bias", "tools", "tool_choice",
    "functions", "function_call", "modalities", "audio", "prediction", "reasoning_effort",
    "web_search_options", "add_generation_prompt",
}


def parse_completion_request(body: dict[str, Any]) -> OpenAIRequest:
    """Check a /v1/completions body."""
    body = _check_fields(body, _COMPLETION_FIELDS)
    _refuse_if(body.get("echo") is True, "echo", "'echo' is not supported")
    _refuse_if(body.get("suffix") not in (None, ""), "suffix", "'suffix' is not supported")
    _refuse_if(bool(body.get("logit_bias")), "logit_bias", "'logit_bias' is not supported")
    if "prompt" not in body:
        raise HandlerError("'prompt' is required")
    prompt = body["prompt"]
    if isinstance(prompt, list) and prompt and all(isinstance(p, (str, list)) for p in prompt):
        # A batch of prompts: accepted with one entry, which is the common client habit.
        if len(prompt) != 1:
            raise HandlerError(f"'prompt' holds {len(prompt)} prompts; send one prompt per request")
        prompt = prompt[0]
    spec = prompt_spec(prompt, "prompt")
    logprobs = _optional_int(body, "logprobs", 0, MAX_LOGPROBS)
    params = _sampling_params(body, max_tokens=_optional_int(body, "max_tokens", 1, None, default=16),
                              logprobs=logprobs)
    best_of = _optional_int(body, "best_of", 1, None)
    _refuse_if(best_of is not None and best_of != params.n, "best_of", "'best_of' other than n is not supported")
    stream, include_usage = _stream_fields(body)
    return OpenAIRequest(Endpoint.COMPLETIONS, _model(body), spec, params, stream, include_usage,
                         logprobs=logprobs is not None, top_logprobs=logprobs or 0)


def parse_chat_request(body: dict[str, Any]) -> OpenAIRequest:
    """Check a /v1/chat/completions body."""
    body = _check_fields(body, _CHAT_FIELDS)
    for name in ("tools", "functions", "logit_bias", "audio", "prediction", "web_search_options"):
        _refuse_if(bool(body.get(name)), name, f"'{name}' is not supported")
    for name in ("tool_choice", "function_call"):
        _refuse_if(body.get(name) not in (None, "none"), name, f"'{name}' is not supported (no tools)")
    _refuse_if(body.get("reasoning_effort") is not None, "reasoning_effort", "'reasoning_effort' is not supported")
    modalities = body.get("modalities")
    _refuse_if(modalities is not None and modalities != ["text"], "modalities", "only the 'text' modality is supported")
    if "messages" not in body:
        raise HandlerError("'messages' is required")
    add_generation_prompt = body.get("add_generation_prompt", True)
    if not isinstance(add_generation_prompt, bool):
        raise HandlerError("'add_generation_prompt' must be a boolean")
    spec = PromptSpec(messages=check_messages(body["messages"]), add_generation_prompt=add_generation_prompt)
    want_logprobs = body.get("logprobs") or False
    if not isinstance(want_logprobs, bool):
        raise HandlerError(f"'logprobs' must be a boolean, got {want_logprobs!r}")
    top = _optional_int(body, "top_logprobs", 0, MAX_LOGPROBS)
    _refuse_if(top is not None and not want_logprobs, "top_logprobs", "'top_logprobs' needs 'logprobs': true")
    max_tokens = _optional_int(body, "max_tokens", 1, None)
    max_completion = _optional_int(body, "max_completion_tokens", 1, None)
    if max_tokens is not None and max_completion is not None and max_tokens != max_completion:
        raise HandlerError("'max_tokens' and 'max_completion_tokens' disagree; give one")
    params = _sampling_params(body, max_tokens=max_completion if max_completion is not None else max_tokens,
                              logprobs=(top or 0) if want_logprobs else None)
    stream, include_usage = _stream_fields(body)
    return OpenAIRequest(Endpoint.CHAT, _model(body), spec, params, stream, include_usage,
                         logprobs=want_logprobs, top_logprobs=top or 0)


def split_model(name: str) -> tuple[str, str | None]:
    """`model@version` -> (model, version); a bare name -> (name, None)."""
    model, sep, version = name.partition("@")
    return model, (version if sep and version else None)


# -- helpers -------------------------------------------------------------------------------------

def _check_fields(body: dict[str, Any], allowed: frozenset[str] | set[str]) -> dict[str, Any]:
    unknown = set(body) - set(allowed) - _IGNORED
    if unknown:
        raise HandlerError(f"unrecognized request argument(s) supplied: {sorted(unknown)}")
    return {k: v for k, v in body.items() if v is not None and k not in _IGNORED}


def _refuse_if(condition: bool, field: str, message: str) -> None:
    if condition:
        raise HandlerError(message, param=field)


def _model(body: dict[str, Any]) -> str | None:
    model = body.get("model")
    if model is not None and (not isinstance(model, str) or not model):
        raise HandlerError(f"'model' must be a non-empty string, got {model!r}")
    return model


def _optional_int(body: dict[str, Any], name: str, minimum: int | None, maximum: int | None,
                  default: int | None = None) -> int | None:
    value = body.get(name)
    if value is None:
        return default
    if isinstance(value, bool) or not isinstance(value, int):
        raise HandlerError(f"'{name}' must be an integer, got {value!r}")
    if minimum is not None and value < minimum:
        raise HandlerError(f"'{name}' must be >= {minimum}, got {value}")
    if maximum is not None and value > maximum:
        raise HandlerError(f"'{name}' must be <= {maximum}, got {value}")
    return value


def _sampling_params(body: dict[str, Any], *, max_tokens: int | None, logprobs: int | None) -> SamplingParams:
    fields: dict[str, Any] = {}
    for name, types in _SAMPLING_TYPES.items():
        if name not in body:
            continue
        value = body[name]
        if (isinstance(value, bool) and bool not in types) or not isinstance(value, types):
            kind = "a boolean" if types == (bool,) else "an integer" if types == (int,) else "a number"
            raise HandlerError(f"'{name}' must be {kind}, got {value!r}")
        fields[name] = value
    if fields.get("n", 1) > MAX_N:
        raise HandlerError(f"'n' must be <= {MAX_N}, got {fields['n']}")
    stop = body.get("stop")
    if stop is not None:
        if isinstance(stop, str):
            stop = [stop]
        if not isinstance(stop, list) or not all(isinstance(s, str) and s for s in stop):
            raise HandlerError("'stop' must be a non-empty string or a list of non-empty strings")
        fields["stop"] = stop
    stop_ids = body.get("stop_token_ids")
    if stop_ids is not None:
        if not isinstance(stop_ids, list) or not all(isinstance(t, int) and not isinstance(t, bool) for t in stop_ids):
            raise HandlerError("'stop_token_ids' must be a list of integers")
        fields["stop_token_ids"] = stop_ids
    structured = _structured_outputs(body)
    if structured is not None:
        fields["structured_outputs"] = structured
    return make_sampling_params({**fields, "max_tokens": max_tokens, "logprobs": logprobs})


def _structured_outputs(body: dict[str, Any]) -> dict[str, Any] | None:
    """The one structured-output constraint the body asks for, as StructuredOutputsParams fields."""
    given = sorted(name for name in _STRUCTURED_FIELDS if name in body)
    fmt = body.get("response_format")
    if fmt == {"type": "text"}:
        given.remove("response_format")
    if len(given) > 1:
        raise HandlerError(f"give one structured-output field, not {', '.join(given)}", param=given[1])
    if not given:
        return None
    name = given[0]
    if name in _GUIDED:
        return {_GUIDED[name]: body[name]}
    if name == "structured_outputs":
        if not isinstance(body[name], dict):
            raise HandlerError("'structured_outputs' must be an object", param=name)
        return body[name]
    return _response_format(fmt)


def _response_format(fmt: Any) -> dict[str, Any]:
    kind = fmt.get("type") if isinstance(fmt, dict) else None
    if kind == "json_object":
        return {"json_object": True}
    if kind == "json_schema":
        spec = fmt.get("json_schema")
        if not isinstance(spec, dict) or not isinstance(spec.get("schema"), dict):
            raise HandlerError("response_format json_schema needs 'json_schema': {'name': ..., 'schema': {...}}",
                               param="response_format")
        return {"json": spec["schema"]}
    raise HandlerError("response_format must be {'type': 'text'}, {'type': 'json_object'} or "
                       "{'type': 'json_schema', 'json_schema': {...}}", param="response_format")


def _stream_fields(body: dict[str, Any]) -> tuple[bool, bool]:
    stream = body.get("stream", False)
    if not isinstance(stream, bool):
        raise HandlerError(f"'stream' must be a boolean, got {stream!r}")
    options = body.get("stream_options")
    if options is None:
        return stream, False
    if not stream:
        raise HandlerError("'stream_options' is only allowed when 'stream' is true")
    if not isinstance(options, dict) or set(options) - {"include_usage", "continuous_usage_stats"}:
        raise HandlerError("'stream_options' must be an object with 'include_usage'")
    include_usage = options.get("include_usage", False)
    if not isinstance(include_usage, bool):
        raise HandlerError("'stream_options.include_usage' must be a boolean")
    return stream, include_usage
