"""OpenAI request bodies (`/v1/completions`, `/v1/chat/completions`) -> engine inputs.

Each body is declared once as a msgspec Struct (`CompletionBody`, `ChatBody`); its sampling
fields are SamplingParams' own declaration, so every bound is the one the worker decodes with.
Three kinds of other fields: supported ones; fields OpenAI accepts that change nothing here
(`user`, `store`, `metadata`, ...) are ignored; fields OpenAI accepts that this server cannot
honour (`suffix`, `audio`, ...) are refused with a 400 naming them; anything else is an unknown
field and refused, as OpenAI does. `null` means "not given". A completions body may hold a list of
up to MAX_PROMPTS prompts (one choice set each); `logit_bias` maps token ids (as JSON object keys)
to a bias in [-100, 100].
vLLM's extra sampling fields (`top_k`, `min_p`, `repetition_penalty`, ...) are accepted, and so is
structured output: OpenAI's `response_format` (`json_object`, `json_schema`), vLLM's
`structured_outputs` and its older `guided_json` / `guided_regex` / `guided_choice` / `guided_grammar`.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass
from typing import Annotated, Any

import msgspec
from msgspec import Meta

from pagedserve.engine.sampling.params import MAX_LOGPROBS, MAX_TOKENS, SamplingParams, TokenId
from pagedserve.engine.structured_output.params import StructuredOutputsParams
from pagedserve.handlers.errors import HandlerError
from pagedserve.handlers.llm_input import ChatMessages, PromptSpec, chat_messages, convert_body, make_sampling_params
from pagedserve.handlers.openai_tools import ToolChoice, ToolRequest, Tools, tool_request

# SamplingParams fields a body sets under their own names; max_tokens, logprobs and structured
# output have route-specific forms (below).
SAMPLING_FIELDS = frozenset(f.name for f in msgspec.structs.fields(SamplingParams)) - {
    "max_tokens",
    "logprobs",
    "structured_outputs",
}
MAX_PROMPTS = 32  # prompts in one /v1/completions body
_Logprobs = Annotated[int, Meta(ge=0, le=MAX_LOGPROBS)]
_MaxTokens = Annotated[int, Meta(ge=1, le=MAX_TOKENS)]
_Text = Annotated[str, Meta(min_length=1)]


class Endpoint(enum.Enum):
    COMPLETIONS = "completions"
    CHAT = "chat"


@dataclass(slots=True)
class OpenAIRequest:
    """A checked OpenAI request: what to tokenize, how to sample, how to answer."""

    endpoint: Endpoint
    model: str | None  # the body's `model` (a route prefix may select the model instead)
    prompts: list[PromptSpec]  # one for chat; completions: one choice set of `n` per prompt
    params: SamplingParams
    stream: bool = False
    include_usage: bool = False  # stream_options.include_usage
    logprobs: bool = False  # answer with logprobs
    top_logprobs: int = 0  # alternatives per token (completions: the `logprobs` integer)
    echo: bool = False  # completions: each choice's text starts with its prompt
    tools: ToolRequest | None = None  # chat: the tools offered (pagedserve.handlers.openai_tools)
    priority: int = 0  # vLLM's: lower first under scheduling_policy "priority"
    cache_salt: str | None = None  # vLLM's: prefix-cache hits only among requests with the same salt
    kv_produce: bool = False  # kv_transfer_params.do_remote_decode: KV written through before answering


class StreamOptions(msgspec.Struct, forbid_unknown_fields=True):
    include_usage: bool = False
    continuous_usage_stats: bool = False


class JsonSchemaFormat(msgspec.Struct, forbid_unknown_fields=True):
    schema: dict[str, Any]
    name: str | None = None
    description: str | None = None
    strict: bool | None = None


class TextFormat(msgspec.Struct, tag="text", tag_field="type", forbid_unknown_fields=True):
    pass


class JsonObjectFormat(msgspec.Struct, tag="json_object", tag_field="type", forbid_unknown_fields=True):
    pass


class JsonSchemaResponseFormat(msgspec.Struct, tag="json_schema", tag_field="type", forbid_unknown_fields=True):
    json_schema: JsonSchemaFormat


ResponseFormat = TextFormat | JsonObjectFormat | JsonSchemaResponseFormat


class KVTransferParams(msgspec.Struct, forbid_unknown_fields=True):
    """vLLM's `kv_transfer_params`, as its disaggregated-prefill proxy sends them. Only
    `do_remote_decode` acts here: the server computes the prompt and writes its KV through the
    KV offload connector before it answers, so another server sharing that tier (Redis) finds it
    (pagedserve.server.workers.disagg). The other keys (NIXL's hand-off details) are accepted."""

    do_remote_decode: bool = False
    do_remote_prefill: bool = False  # the decode side: its lookup finds the KV anyway
    remote_engine_id: Any = None
    remote_block_ids: Any = None
    remote_host: Any = None
    remote_port: Any = None


class _OpenAIBody(msgspec.Struct, forbid_unknown_fields=True, kw_only=True):
    """Fields both routes share (the sampling fields are SamplingParams')."""

    model: Annotated[str, Meta(min_length=1)] | None = None
    stream: bool = False
    stream_options: StreamOptions | None = None
    max_tokens: _MaxTokens | None = None
    # Structured output: at most one of these.
    response_format: ResponseFormat | None = None
    structured_outputs: StructuredOutputsParams | None = None
    guided_json: str | dict[str, Any] | None = None
    guided_regex: _Text | None = None
    guided_choice: Annotated[list[_Text], Meta(min_length=1)] | None = None
    guided_grammar: _Text | None = None
    # vLLM's request fields: the scheduling priority (lower first, under scheduling_policy
    # "priority") and a tenant's salt for the prefix cache's block hashes.
    priority: Annotated[int, Meta(ge=-(1 << 31), le=(1 << 31) - 1)] = 0
    cache_salt: Annotated[str, Meta(min_length=1, max_length=256)] | None = None
    kv_transfer_params: KVTransferParams | None = None  # vLLM's disaggregated prefill (see KVTransferParams)
    # Accepted by OpenAI, no effect here.
    user: Any = None
    store: Any = None
    metadata: Any = None
    service_tier: Any = None
    prompt_cache_key: Any = None
    safety_identifier: Any = None


class CompletionBody(_OpenAIBody, kw_only=True):
    # One prompt (text or token ids) or a list of prompts (texts or token-id lists).
    prompt: str | list[str | TokenId | list[TokenId]]
    logprobs: _Logprobs | None = None
    best_of: Annotated[int, Meta(ge=1)] | None = None
    echo: bool | None = None
    suffix: str | None = None


class ChatBody(_OpenAIBody, kw_only=True):
    messages: ChatMessages
    logprobs: bool = False
    top_logprobs: _Logprobs | None = None
    max_completion_tokens: _MaxTokens | None = None
    add_generation_prompt: bool = True
    tools: Tools | None = None
    tool_choice: ToolChoice | None = None
    parallel_tool_calls: bool | None = None
    functions: Any = None
    audio: Any = None
    prediction: Any = None
    web_search_options: Any = None
    function_call: Any = None
    reasoning_effort: Any = None
    modalities: list[str] | None = None


_GUIDED = {"guided_json": "json", "guided_regex": "regex", "guided_choice": "choice", "guided_grammar": "grammar"}


def parse_completion_request(body: dict[str, Any]) -> OpenAIRequest:
    """Check a /v1/completions body."""
    req, sampling = _split(body, CompletionBody)
    _refuse_if(req.suffix not in (None, ""), "suffix", "not supported")
    _refuse_if(
        bool(req.echo) and req.logprobs is not None,
        "echo",
        "cannot be combined with logprobs (prompt logprobs are not computed)",
    )
    specs = _completion_prompts(req.prompt)
    params = _sampling_params(
        req, sampling, max_tokens=16 if req.max_tokens is None else req.max_tokens, logprobs=req.logprobs
    )
    _refuse_if(req.best_of is not None and req.best_of != params.n, "best_of", "other than n is not supported")
    return OpenAIRequest(
        Endpoint.COMPLETIONS,
        req.model,
        specs,
        params,
        req.stream,
        _include_usage(req),
        logprobs=req.logprobs is not None,
        top_logprobs=req.logprobs or 0,
        echo=bool(req.echo),
        priority=req.priority,
        cache_salt=req.cache_salt,
        kv_produce=req.kv_transfer_params is not None and req.kv_transfer_params.do_remote_decode,
    )


def parse_chat_request(body: dict[str, Any]) -> OpenAIRequest:
    """Check a /v1/chat/completions body."""
    req, sampling = _split(body, ChatBody)
    _refuse_unsupported(req, ("functions", "audio", "prediction", "web_search_options"))
    _refuse_if(req.function_call not in (None, "none"), "function_call", "not supported (use tools)")
    tools = tool_request(req.tools, req.tool_choice, req.parallel_tool_calls)
    _refuse_if(req.reasoning_effort is not None, "reasoning_effort", "not supported")
    _refuse_if(req.modalities is not None and req.modalities != ["text"], "modalities", "only [\"text\"] is supported")
    spec = PromptSpec(messages=chat_messages(req.messages), add_generation_prompt=req.add_generation_prompt)
    _refuse_if(req.top_logprobs is not None and not req.logprobs, "top_logprobs", "needs \"logprobs\": true")
    if (
        req.max_tokens is not None
        and req.max_completion_tokens is not None
        and req.max_tokens != req.max_completion_tokens
    ):
        raise HandlerError(
            f"max_tokens: {req.max_tokens} and max_completion_tokens: {req.max_completion_tokens} disagree; give one",
            param="max_tokens",
        )
    max_tokens = req.max_completion_tokens if req.max_completion_tokens is not None else req.max_tokens
    params = _sampling_params(
        req,
        sampling,
        max_tokens=max_tokens,
        logprobs=(req.top_logprobs or 0) if req.logprobs else None,
        tool_schema=None if tools is None else tools.constraint(),
    )
    return OpenAIRequest(
        Endpoint.CHAT,
        req.model,
        [spec],
        params,
        req.stream,
        _include_usage(req),
        logprobs=req.logprobs,
        top_logprobs=req.top_logprobs or 0,
        tools=tools,
        priority=req.priority,
        cache_salt=req.cache_salt,
        kv_produce=req.kv_transfer_params is not None and req.kv_transfer_params.do_remote_decode,
    )


def split_model(name: str, field: str = "model") -> tuple[str, str | None]:
    """`model@version` -> (model, version); a bare name -> (name, None). A name with an empty
    side of its `@` (`model@`, `@1.0`) or a second `@` is refused (HandlerError naming `field`)."""
    model, sep, version = name.partition("@")
    if sep and (not model or not version or "@" in version):
        raise HandlerError(
            f"{field}: {name[:80]!r} is not a model name: write model or model@version (both parts non-empty)",
            param=field,
        )
    return model, (version if sep else None)


# -- helpers -------------------------------------------------------------------------------------


def _split(body: dict[str, Any], schema: type[_OpenAIBody]) -> tuple[Any, dict[str, Any]]:
    """The body without nulls -> (the route's Struct, the sampling fields for SamplingParams)."""
    given = {k: v for k, v in body.items() if v is not None}
    sampling = {k: v for k, v in given.items() if k in SAMPLING_FIELDS}
    req = convert_body({k: v for k, v in given.items() if k not in SAMPLING_FIELDS}, schema)
    return req, sampling


def _refuse_if(condition: bool, field: str, message: str) -> None:
    if condition:
        raise HandlerError(f"{field}: {message}", param=field)


def _refuse_unsupported(req: _OpenAIBody, names: tuple[str, ...]) -> None:
    for name in names:
        _refuse_if(bool(getattr(req, name)), name, "not supported")


def _completion_prompts(prompt: str | list[Any]) -> list[PromptSpec]:
    """`prompt` -> one PromptSpec per prompt: a string, a list of token ids, or a list of up to
    MAX_PROMPTS strings or token-id lists (not mixed with bare ids)."""
    if isinstance(prompt, str):
        return [PromptSpec(text=prompt)]
    if prompt and all(isinstance(t, int) for t in prompt):
        return [PromptSpec(token_ids=list(prompt))]
    if not 1 <= len(prompt) <= MAX_PROMPTS:
        raise HandlerError(f"prompt: must hold 1 .. {MAX_PROMPTS} prompts, got {len(prompt)}", param="prompt")
    specs = []
    for i, one in enumerate(prompt):
        if isinstance(one, str):
            specs.append(PromptSpec(text=one))
        elif isinstance(one, list) and one:
            specs.append(PromptSpec(token_ids=list(one)))
        else:
            raise HandlerError(
                f"prompt[{i}]: must be a string or a non-empty list of token ids, got {one!r}", param="prompt"
            )
    return specs


def _sampling_params(
    req: _OpenAIBody,
    sampling: dict[str, Any],
    *,
    max_tokens: int | None,
    logprobs: int | None,
    tool_schema: dict[str, Any] | None = None,
) -> SamplingParams:
    """SamplingParams of a body; `tool_schema` (tool_choice required or a named function) is
    the structured-output constraint, which the body may then not ask for itself."""
    fields = {**sampling, "max_tokens": max_tokens, "logprobs": logprobs}
    structured = _structured_outputs(req)
    if tool_schema is not None:
        _refuse_if(
            structured is not None,
            "tool_choice",
            "\"required\" or a named function cannot be combined with structured output",
        )
        structured = convert_body({"json": tool_schema}, StructuredOutputsParams)
    if structured is not None:
        fields["structured_outputs"] = structured
    return make_sampling_params(fields)


def _structured_outputs(req: _OpenAIBody) -> StructuredOutputsParams | dict[str, Any] | None:
    """The one structured-output constraint the body asks for."""
    given = sorted(
        name
        for name in ("structured_outputs", "response_format", *_GUIDED)
        if getattr(req, name) is not None and not isinstance(getattr(req, name), TextFormat)
    )
    if len(given) > 1:
        raise HandlerError(f"{given[1]}: give one structured-output field, not {', '.join(given)}", param=given[1])
    if not given:
        return None
    name = given[0]
    if name in _GUIDED:
        return convert_body({_GUIDED[name]: getattr(req, name)}, StructuredOutputsParams)
    if name == "structured_outputs":
        return req.structured_outputs
    fmt = req.response_format
    if isinstance(fmt, JsonObjectFormat):
        return StructuredOutputsParams(json_object=True)
    return convert_body({"json": fmt.json_schema.schema}, StructuredOutputsParams)


def _include_usage(req: _OpenAIBody) -> bool:
    if req.stream_options is None:
        return False
    if not req.stream:
        raise HandlerError("stream_options: only allowed when stream is true", param="stream_options")
    return req.stream_options.include_usage
