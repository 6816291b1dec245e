"""POST /v1/embeddings: the body (declared once), its prompts, and OpenAI's reply.

The served model embeds a text as the final hidden state of its last token, L2-normalised
(pagedserve.engine.request.pooling: a pooling request on the engine's one request path). `input` is a string, a
list of token ids, or a list of up to MAX_INPUTS strings or token-id lists (OpenAI's limit);
each is its own engine request. `encoding_format` is `float` (a list of numbers) or `base64`
(the little-endian float32 bytes, base64-encoded: what the official SDK asks for by default and
decodes). `dimensions` is refused (the vector has the model's hidden size; no shortening); `user`
is accepted and ignored.
"""

from __future__ import annotations

import base64
from dataclasses import dataclass
from typing import Any, Literal

import msgspec
import numpy as np

from pagedserve.engine.request.inputs import PromptSpec
from pagedserve.engine.request.outputs import RequestOutput
from pagedserve.engine.sampling.params import TokenId
from pagedserve.handlers.errors import HandlerError
from pagedserve.handlers.llm_input import convert_body

MAX_INPUTS = 2048  # inputs in one body (OpenAI's limit)
EncodingFormat = Literal["float", "base64"]


class EmbeddingsBody(msgspec.Struct, forbid_unknown_fields=True, kw_only=True):
    model: str | None = None
    input: str | list[str | TokenId | list[TokenId]]
    encoding_format: EncodingFormat = "float"
    dimensions: int | None = None
    user: str | None = None


@dataclass(slots=True)
class EmbeddingsRequest:
    """A checked /v1/embeddings request: what to embed and how to write the vectors."""

    model: str | None
    prompts: list[PromptSpec]
    encoding_format: EncodingFormat = "float"


def parse_embeddings_request(body: dict[str, Any]) -> EmbeddingsRequest:
    """Check a /v1/embeddings body (HandlerError, 400 naming the field, on refusal)."""
    req = convert_body({k: v for k, v in body.items() if v is not None}, EmbeddingsBody)
    if req.dimensions is not None:
        raise HandlerError("dimensions: not supported (the embedding has the model's hidden size)", param="dimensions")
    return EmbeddingsRequest(req.model, _inputs(req.input), req.encoding_format)


def _inputs(given: str | list[Any]) -> list[PromptSpec]:
    """`input` -> one PromptSpec per input: a string, token ids, or a list of strings or
    token-id lists (not mixed with bare ids); none may be empty."""
    if isinstance(given, str):
        given = [given]
    elif given and all(isinstance(t, int) for t in given):
        given = [given]
    if not 1 <= len(given) <= MAX_INPUTS:
        raise HandlerError(f"input: must hold 1 .. {MAX_INPUTS} inputs, got {len(given)}", param="input")
    specs = []
    for i, one in enumerate(given):
        if isinstance(one, str) and one:
            specs.append(PromptSpec(text=one))
        elif isinstance(one, list) and one:
            specs.append(PromptSpec(token_ids=list(one)))
        else:
            raise HandlerError(
                f"input[{i}]: must be a non-empty string or a non-empty list of token ids, got {one!r}", param="input"
            )
    return specs


def embeddings_response(request: EmbeddingsRequest, model: str, out: RequestOutput) -> dict[str, Any]:
    """OpenAI's reply: one `embedding` object per input (input i's at `index` i), and `usage`."""
    data = [
        {"object": "embedding", "index": c.index, "embedding": _encode(c.embedding, request.encoding_format)}
        for c in sorted(out.outputs, key=lambda c: c.index)
    ]
    tokens = len(out.prompt_token_ids)
    return {"object": "list", "data": data, "model": model, "usage": {"prompt_tokens": tokens, "total_tokens": tokens}}


def _encode(vector: list[float] | None, encoding_format: EncodingFormat) -> list[float] | str:
    if vector is None:  # the engine ended the request without pooling it (aborted)
        raise HandlerError("the engine returned no embedding", code=500)
    if encoding_format == "base64":
        return base64.b64encode(np.asarray(vector, dtype="<f4").tobytes()).decode("ascii")
    return vector
