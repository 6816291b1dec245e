"""What every generation route on the inference port does around the shared request path
(pagedserve.server.serving.generation), whichever API it speaks: read the JSON body, resolve the model version a
name asks for (a LoRA adapter's name runs on its base version), count the request in flight on
its version (with its `keep_alive`) and adapter, and turn the handlers' refusals into
`ErrorReply`s. The OpenAI routes (pagedserve.server.openai), Ollama's (pagedserve.server.ollama) and
Anthropic's (pagedserve.server.anthropic) all use these."""

from __future__ import annotations

import contextlib
import json
from collections.abc import Callable
from typing import Any, TypeVar

from aiohttp import web

from pagedserve.handlers.base_handler import HandlerError
from pagedserve.handlers.llm_input import decode_body
from pagedserve.server.common.keep_alive import KeepAliveError, take_keep_alive
from pagedserve.server.serving.generation import MODEL_KEY, ErrorReply
from pagedserve.server.serving.state import STATE_KEY, ServerState
from pagedserve.server.workers.adapters import RegisteredAdapter
from pagedserve.server.workers.rules import InvalidNameError, ModelNotFoundError
from pagedserve.server.workers.version import ModelVersion

_In = TypeVar("_In")
_Out = TypeVar("_Out")

ADAPTER_KEY = web.RequestKey("pagedserve_adapter", RegisteredAdapter)  # a request naming a LoRA adapter


def resolve(request: web.Request, state: ServerState, name: str, version: str | None) -> ModelVersion:
    """The model version to run; for a LoRA adapter's name, its base version (the adapter is
    kept in `request[ADAPTER_KEY]`). 404 naming `model` when there is neither; a name or
    version no registration could have (control characters, `/`, ...) is a 400 naming the rule,
    not a lookup."""
    try:
        found = state.registry.resolve(name, version)
    except InvalidNameError as exc:
        raise ErrorReply(400, str(exc), param="model") from None
    except ModelNotFoundError as exc:
        adapter = state.adapters.get(name) if version is None else None
        if adapter is None:
            raise ErrorReply(404, str(exc), param="model") from None
        request[ADAPTER_KEY] = adapter
        found = adapter.base
    request[MODEL_KEY] = found.name
    return found


def lora(request: web.Request):
    """The LoRA adapter a request runs under (None: the base model)."""
    adapter = request.get(ADAPTER_KEY)
    return None if adapter is None else adapter.lora


def adapter_in_flight(request: web.Request) -> contextlib.AbstractContextManager:
    """Counts the request against its adapter while it runs (unregistering waits for it)."""
    adapter = request.get(ADAPTER_KEY)
    return contextlib.nullcontext() if adapter is None else adapter.track()


@contextlib.contextmanager
def admitted(request: web.Request, version: ModelVersion, keep_alive: float | None):
    """A request counted in flight on its version (with its `keep_alive` in seconds) and on
    its LoRA adapter, for the whole `with` block."""
    with version.admit(keep_alive), adapter_in_flight(request):
        yield


def keep_alive(body: dict[str, Any]) -> float | None:
    """The request's `keep_alive` (taken out of the body), in seconds; 400 when malformed."""
    try:
        return take_keep_alive(body)
    except KeepAliveError as exc:
        raise ErrorReply(400, str(exc), param=exc.field) from None


def raw_keep_alive(raw: bytes) -> tuple[bytes, float | None]:
    """A custom handler's body and the `keep_alive` it holds: when the body is a JSON object
    with that field, the field is the server's (as on the built-in path) and the handler gets
    the body without it; any other body goes to the handler as sent."""
    if b'"keep_alive"' not in raw:
        return raw, None
    try:
        body = json.loads(raw)
    except (ValueError, RecursionError):
        return raw, None
    if not isinstance(body, dict):
        return raw, None
    seconds = keep_alive(body)
    return json.dumps(body).encode(), seconds


def handler_call(parse: Callable[[_In], _Out], body: _In) -> _Out:
    """`parse(body)` with a handler's refusal as an ErrorReply (its status, naming the field)."""
    try:
        return parse(body)
    except HandlerError as exc:
        raise ErrorReply.from_handler_error(exc) from None


async def read_json(request: web.Request) -> dict[str, Any]:
    """The request's JSON object body (size, depth and encoding checked: pagedserve.handlers.json_body)."""
    raw = await request.read()  # too large (413), unreadable (400), too slow (408): middleware
    try:
        return decode_body(raw, request.app[STATE_KEY].config.max_request_size)
    except HandlerError as exc:
        raise ErrorReply.from_handler_error(exc) from None
