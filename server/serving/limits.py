"""Front-end limits on the expensive work one request can cause before it reaches a worker.

Two kinds of request used to hold the whole front end up (issue 11):

- **Structured-output pre-checks.** Parsing a constraint (xgrammar, GIL released) is fast for
  ordinary schemas, but deep ones cost seconds to minutes, and the parse used to run on the
  tokenization threads with no time limit: four such requests starved every other request's
  tokenization. Now the size and nesting bounds of engine/structured_output/limits.py refuse those at
  once (400), and what passes runs on `GrammarChecks`, a small pool of its own, with
  - a time limit (GRAMMAR_CHECK_TIMEOUT_S, waiting included): a check still running then
    answers 400 (the constraint is too expensive); a check still waiting for a thread, 503;
  - a share per client (peer address): one client's checks hold at most PER_CLIENT_THREADS of
    the GRAMMAR_THREADS threads at once (its other checks wait their turn), and at most
    PER_CLIENT_ADMITTED checks of one client are admitted at a time (more: 429);
  - a bounded queue: at most MAX_ADMITTED checks admitted in all (more: 503, Retry-After).
  A check that outlives its time limit keeps its thread (a C++ parse cannot be interrupted) and
  its client's share until it ends; tokenization never waits for it.

- **Huge prompts.** Tokenizing a 6 MB prompt makes the fast tokenizer allocate about 800 MB in
  the calling thread's malloc arena; glibc keeps it after the refusal, once per front-end
  thread (381 MB -> 3.8 GB after eight). `check_prompt_chars` refuses, before tokenizing, a
  prompt whose text needs more tokens than max_model_len holds even if every token stood for
  the longest token in the vocabulary; `tokenize` hands the memory of a large tokenization back
  to the system (malloc_trim) once it is done.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import ctypes
import weakref
from collections.abc import Callable
from typing import Any

from pagedserve.engine.request.inputs import PromptSpec, render_prompt
from pagedserve.engine.structured_output.params import StructuredOutputsParams, check_grammar
from pagedserve.handlers.base_handler import HandlerError

GRAMMAR_THREADS = 2  # the pool that runs structured-output pre-checks
PER_CLIENT_THREADS = 1  # of those, what one client's checks may hold at once
PER_CLIENT_ADMITTED = 4  # one client's checks running or waiting; more: 429
MAX_ADMITTED = 16  # all checks running or waiting; more: 503
GRAMMAR_CHECK_TIMEOUT_S = 10.0  # per check, from its arrival (typical checks take milliseconds)
TRIM_AFTER_CHARS = 1 << 18  # a tokenization of more text returns freed memory to the system
NORMALIZER_SLACK = 4  # a tokenizer that normalizes may shrink text: the bound allows this much


class LimitRefused(Exception):
    """A request refused by a front-end limit: reply `code` with `message` and `headers`."""

    def __init__(self, code: int, message: str, headers: dict[str, str] | None = None) -> None:
        super().__init__(message)
        self.code = code
        self.headers = headers or {}


class GrammarChecks:
    """Structured-output pre-checks on a small thread pool of their own, with a time limit, a
    share per client and a bounded queue (see the module docstring). Used from one event loop."""

    def __init__(
        self,
        threads: int = GRAMMAR_THREADS,
        *,
        per_client: int = PER_CLIENT_THREADS,
        per_client_admitted: int = PER_CLIENT_ADMITTED,
        max_admitted: int = MAX_ADMITTED,
        timeout_s: float = GRAMMAR_CHECK_TIMEOUT_S,
        check: Callable[[StructuredOutputsParams], None] = check_grammar,
    ) -> None:
        self.threads = threads
        self.per_client = per_client
        self.per_client_admitted = per_client_admitted
        self.max_admitted = max_admitted
        self.timeout_s = timeout_s
        self._check = check
        self._pool = concurrent.futures.ThreadPoolExecutor(threads, thread_name_prefix="pagedserve-grammar")
        self._running = 0  # checks on a thread (timed-out ones included, until they end)
        self._running_by_client: dict[str, int] = {}
        self._admitted_by_client: dict[str, int] = {}  # running or waiting
        self._waiters: list[asyncio.Future] = []

    @property
    def admitted(self) -> int:
        return sum(self._admitted_by_client.values())

    async def check(self, client: str, params: StructuredOutputsParams) -> None:
        """Run check_grammar for `client`'s request within the limits; GrammarError or
        ConstraintTooLarge (ValueError) as check_grammar raises them, LimitRefused otherwise."""
        loop = asyncio.get_running_loop()
        deadline = loop.time() + self.timeout_s
        if self.admitted >= self.max_admitted:
            raise LimitRefused(
                503,
                f"{self.admitted} structured-output checks are already waiting or running; try again shortly",
                {"Retry-After": "1"},
            )
        if self._admitted_by_client.get(client, 0) >= self.per_client_admitted:
            raise LimitRefused(
                429,
                f"this client already has {self.per_client_admitted} structured-output checks waiting or running",
                {"Retry-After": "1"},
            )
        _add(self._admitted_by_client, client, 1)
        started = False
        try:
            await self._wait_for_thread(client, deadline)
            started = True
            self._running += 1
            _add(self._running_by_client, client, 1)
            future = self._pool.submit(self._check, params)
            future.add_done_callback(lambda _: loop.call_soon_threadsafe(self._finished, client))
            try:
                await asyncio.wait_for(asyncio.shield(asyncio.wrap_future(future)), deadline - loop.time())
            except asyncio.TimeoutError:
                raise LimitRefused(
                    400, f"the structured output constraint took longer than {self.timeout_s:g} s to check; simplify it"
                ) from None
        finally:
            if not started:  # left the queue (refused or cancelled): the client's place is free
                _add(self._admitted_by_client, client, -1)

    async def _wait_for_thread(self, client: str, deadline: float) -> None:
        loop = asyncio.get_running_loop()
        while self._running >= self.threads or self._running_by_client.get(client, 0) >= self.per_client:
            waiter = loop.create_future()
            self._waiters.append(waiter)
            try:
                await asyncio.wait_for(waiter, deadline - loop.time())
            except asyncio.TimeoutError:
                raise LimitRefused(
                    503, "the structured-output checks are busy; try again shortly", {"Retry-After": "1"}
                ) from None
            finally:
                with contextlib.suppress(ValueError):
                    self._waiters.remove(waiter)

    def _finished(self, client: str) -> None:
        """A check left its thread (on the event loop): free its thread and its client's share."""
        self._running -= 1
        _add(self._running_by_client, client, -1)
        _add(self._admitted_by_client, client, -1)
        for waiter in self._waiters:
            if not waiter.done():
                waiter.set_result(None)

    def shutdown(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)


def _add(counts: dict[str, int], key: str, n: int) -> None:
    value = counts.get(key, 0) + n
    if value > 0:
        counts[key] = value
    else:
        counts.pop(key, None)


class PromptBounds:
    """The most characters one token of a tokenizer can stand for (cached per tokenizer), and
    the character bound of a prompt that follows from it."""

    def __init__(self) -> None:
        self._token_chars: weakref.WeakKeyDictionary[Any, int | None] = weakref.WeakKeyDictionary()

    def max_token_chars(self, tokenizer: Any) -> int | None:
        """Longest vocabulary entry or added token, times NORMALIZER_SLACK when the tokenizer
        normalizes text first; None for a tokenizer without a vocabulary to read."""
        try:
            return self._token_chars[tokenizer]
        except (KeyError, TypeError):
            pass
        value = _max_token_chars(tokenizer)
        with contextlib.suppress(TypeError):  # not weak-referenceable: computed every time
            self._token_chars[tokenizer] = value
        return value

    def check_prompt_chars(self, tokenizer: Any, spec: PromptSpec, max_model_len: int | None) -> None:
        """HandlerError (400, naming the field) when the prompt's text cannot fit: more
        characters than (max_model_len - 1) tokens of the longest kind hold. Chat messages
        count their contents (the template only adds to them)."""
        if max_model_len is None or spec.token_ids is not None:
            return
        per_token = self.max_token_chars(tokenizer)
        if per_token is None:
            return
        if spec.messages is not None:
            field, chars = "messages", sum(len(m["content"]) for m in spec.messages)
        else:
            field, chars = "prompt", len(spec.text or "")
        limit = (max_model_len - 1) * per_token
        if chars > limit:
            raise HandlerError(
                f"'{field}' has {chars} characters, more than {max_model_len - 1} "
                f"tokens can hold (max_model_len is {max_model_len}; one token of "
                f"this model stands for at most {per_token} characters, so at most "
                f"{limit} fit)",
                param=field,
            )

    def tokenize(self, tokenizer: Any, spec: PromptSpec, max_model_len: int | None) -> tuple[str | None, list[int]]:
        """check_prompt_chars, then render_prompt; after a large text, malloc_trim."""
        self.check_prompt_chars(tokenizer, spec, max_model_len)
        text, token_ids = render_prompt(tokenizer, spec)
        if text is not None and len(text) > TRIM_AFTER_CHARS:
            release_free_memory()
        return text, token_ids


def _max_token_chars(tokenizer: Any) -> int | None:
    get_vocab = getattr(tokenizer, "get_vocab", None)
    if get_vocab is None:
        return None
    try:
        longest = max((len(token) for token in get_vocab()), default=0)
    except (NotImplementedError, TypeError):
        return None
    added = getattr(tokenizer, "added_tokens_decoder", None) or {}
    longest = max([longest, *(len(str(getattr(t, "content", t))) for t in added.values())])
    backend = getattr(tokenizer, "backend_tokenizer", None)
    normalizes = backend is None or getattr(backend, "normalizer", None) is not None
    return max(longest, 1) * (NORMALIZER_SLACK if normalizes else 1)


def release_free_memory() -> None:
    """Return the malloc arenas' free memory to the system (glibc's malloc_trim; elsewhere a no-op).
    Without it, every thread that tokenized a huge text keeps its peak footprint for good."""
    with contextlib.suppress(OSError, AttributeError):
        ctypes.CDLL(None).malloc_trim(0)


class RequestLimits:
    """What the inference routes share: the grammar-check pool and the prompt bounds."""

    def __init__(self) -> None:
        self.grammar = GrammarChecks()
        self.prompts = PromptBounds()

    def shutdown(self) -> None:
        self.grammar.shutdown()
