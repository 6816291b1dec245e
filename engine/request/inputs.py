"""The prepare step of every request path: prompt -> token ids -> checked engine input.

The offline `LLM`, the server's /predictions route and its OpenAI routes all prepare a request
the same way: `render_prompt` tokenizes (chat messages through the model's chat template),
`validate_input` applies the rules that depend only on (token ids, params, limits), and
`prepare_input` does both, after parsing the request's structured-output constraint. This is
the one check a request gets, where it enters: the AsyncLLM and the engine core take an
`EngineInput` as checked and run it. Nothing here needs an engine: a
refusal is an `InvalidInput` (a ValueError naming the field at fault), which the front ends
answer with HTTP 400.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from pagedserve.engine.lora.request import LoRARequest
from pagedserve.engine.request.pooling import PoolingParams
from pagedserve.engine.sampling.params import SamplingParams
from pagedserve.engine.structured_output.params import check_grammar


class InvalidInput(ValueError):
    """A request the engine must refuse before anything is queued; `field` names the part of
    the request at fault (e.g. "prompt", "max_tokens", "messages"), when one is."""

    def __init__(self, message: str, field: str | None = None) -> None:
        super().__init__(message)
        self.field = field


@dataclass(slots=True)
class PromptSpec:
    """What to tokenize: exactly one of text, token ids or chat messages."""

    text: str | None = None
    token_ids: list[int] | None = None
    messages: list[dict[str, Any]] | None = None
    add_generation_prompt: bool = True
    tools: list[dict[str, Any]] | None = None  # for a chat template that renders tools

    def __post_init__(self) -> None:
        given = sum(x is not None for x in (self.text, self.token_ids, self.messages))
        if given != 1:
            raise ValueError("a PromptSpec holds exactly one of text, token_ids or messages")


@dataclass(frozen=True, slots=True)
class InputLimits:
    """What an engine accepts: prompts shorter than `max_model_len`, ids below `vocab_size`.

    `max_tokens_must_fit`: refuse a request whose prompt + max_tokens exceeds max_model_len
    (an OpenAI-style server's rule); without it such a request runs and ends with "length"
    at max_model_len (the offline API's rule, as in vLLM)."""

    max_model_len: int
    vocab_size: int
    max_tokens_must_fit: bool = True


@dataclass(slots=True)
class EngineInput:
    """A prepared request: ready for the engine."""

    prompt: str | None  # the text the token ids came from (None for a token-id prompt)
    token_ids: list[int]
    params: SamplingParams
    pooling: PoolingParams | None = None  # set: return the prompt's embedding, generate nothing
    lora: LoRARequest | None = None  # the LoRA adapter to run under (None: the base model)
    priority: int = 0  # lower first, under scheduling_policy "priority"
    cache_salt: str | None = None  # a tenant's salt: its prefix-cache hits are its own
    # Disaggregated prefill (pagedserve.server.workers.disagg): this worker only computes the
    # prompt and hands its KV on through the offload connector; its writes land before it finishes.
    kv_produce: bool = False


def render_prompt(tokenizer: Any, spec: PromptSpec) -> tuple[str | None, list[int]]:
    """Tokenize a prompt (chat messages through the model's chat template): (text, token ids).
    CPU-bound: the server runs it in a thread."""
    if spec.token_ids is not None:
        return None, list(spec.token_ids)
    if spec.messages is not None:
        import jinja2  # transformers' chat templates are jinja2; imported with them

        if not getattr(tokenizer, "chat_template", None):
            raise InvalidInput(
                "the model has no chat template (a base model): send a plain prompt "
                "(completions), or register the model with a chat template "
                "(POST /models ... chat_template=..., or chat_template.jinja in its archive)",
                "messages",
            )
        try:
            extra = {} if spec.tools is None else {"tools": spec.tools}
            text = tokenizer.apply_chat_template(
                spec.messages, tokenize=False, add_generation_prompt=spec.add_generation_prompt, **extra
            )
        except (jinja2.TemplateError, TypeError, ValueError, KeyError) as exc:  # templates raise their own
            raise InvalidInput(f"the model's chat template refused the messages: {exc}", "messages") from None
        return text, tokenizer.encode(text, add_special_tokens=False)  # the template wrote its own BOS
    # A plain prompt gets the tokenizer's own special tokens, as transformers and vLLM encode it:
    # a BOS for models that want one (Gemma, Llama 3), nothing for those that do not (SmolLM2).
    return spec.text, tokenizer.encode(spec.text, add_special_tokens=True)


def pooling_sampling_params() -> SamplingParams:
    """The SamplingParams of a pooling request: one choice, one step (it samples nothing)."""
    return SamplingParams(n=1, max_tokens=1, temperature=0.0)


def validate_input(token_ids: list[int], params: SamplingParams, limits: InputLimits) -> None:
    """The rules every request path applies before queueing: a non-empty prompt of integer
    ids inside the vocabulary, shorter than max_model_len, and (with `max_tokens_must_fit`)
    room for max_tokens after it. Raises InvalidInput."""
    if not isinstance(params, SamplingParams):
        raise TypeError(f"params must be a SamplingParams, got {type(params).__name__}")
    if not token_ids:
        raise InvalidInput("the prompt must contain at least one token", "prompt")
    vocab_size = limits.vocab_size
    bad = [t for t in token_ids if not isinstance(t, int) or isinstance(t, bool) or not 0 <= t < vocab_size]
    if bad:
        raise InvalidInput(f"token ids out of range [0, {vocab_size}): {bad[:5]}", "prompt")
    if params.logit_bias and max(params.logit_bias) >= vocab_size:
        raise InvalidInput(
            f"logit_bias: token id {max(params.logit_bias)} is outside the vocabulary [0, {vocab_size})", "logit_bias"
        )
    n, max_len = len(token_ids), limits.max_model_len
    if n >= max_len:
        raise InvalidInput(
            f"the prompt has {n} tokens but max_model_len is {max_len}: at most {max_len - 1} prompt tokens fit",
            "prompt",
        )
    if limits.max_tokens_must_fit and params.max_tokens is not None and n + params.max_tokens > max_len:
        raise InvalidInput(
            f"max_tokens={params.max_tokens} is too large: the prompt has {n} tokens and "
            f"max_model_len is {max_len}, so at most {max_len - n} tokens can be generated",
            "max_tokens",
        )


def prepare_input(
    tokenizer: Any, spec: PromptSpec, params: SamplingParams, limits: InputLimits, pooling: PoolingParams | None = None
) -> EngineInput:
    """Parse the structured-output constraint (if any), render and validate one request (with
    `pooling`: a pooling request, see pagedserve.engine.request.pooling). CPU-bound (a big JSON schema takes
    milliseconds): the server runs it in a thread."""
    if params.structured_outputs is not None:
        try:
            check_grammar(params.structured_outputs)
        except ValueError as exc:
            raise InvalidInput(str(exc), "structured_outputs") from None
    text, token_ids = render_prompt(tokenizer, spec)
    validate_input(token_ids, params, limits)
    return EngineInput(text, token_ids, params, pooling)
