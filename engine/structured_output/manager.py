"""Structured output through xgrammar, the engine side: generation constrained to a JSON
schema, any JSON object, a regular expression, one of a list of strings, an EBNF grammar, or a
structural tag (free text until a trigger, then a schema: tool calls).

- `pagedserve.engine.structured_output.params` holds the request side: `StructuredOutputsParams` (on
  SamplingParams) says which constraint; `check_grammar` parses it without a tokenizer.
- In the engine core, `StructuredOutputManager` compiles each request's grammar on a worker
  thread (asynchronously, cached by xgrammar, time-limited); the scheduler leaves a request
  waiting until its grammar is ready. Each step the manager fills one bitmask row per
  structured request that samples; the runner masks forbidden logits before sampling; each
  sampled token then advances the request's matcher. A request whose grammar is complete
  stops (finish reason "stop").
"""

from __future__ import annotations

import concurrent.futures
import threading
import time
from collections.abc import Sequence
from typing import Any, Protocol

import torch

from pagedserve.engine.structured_output.params import StructuredOutputsParams, xgrammar_message, xgrammar_module


class _Params(Protocol):
    @property
    def structured_outputs(self) -> StructuredOutputsParams | None: ...


class Request(Protocol):
    """What the grammar manager reads and writes of a request (pagedserve.engine.request.request.Request): the
    request holds its grammar's state; this module, which makes that state, names only these."""

    @property
    def request_id(self) -> str: ...
    @property
    def sampling_params(self) -> _Params: ...

    grammar: GrammarState | None


COMPILE_TIMEOUT_S = 30.0
ANY_OBJECT_SCHEMA = '{"type": "object"}'


class GrammarState:
    """One request's grammar: the compile in flight, then its matcher."""

    def __init__(self, future: concurrent.futures.Future, deadline: float) -> None:
        self.future = future
        self._deadline = deadline
        self._matcher: Any = None  # xgrammar.GrammarMatcher, once compiled
        self.error: str | None = None

    def poll(self, now: float) -> bool:
        """True once the matcher is ready; sets `error` when the compile failed or timed out."""
        if self._matcher is not None:
            return True
        if self.error is not None:
            return False
        if not self.future.done():
            if now > self._deadline:
                self.error = "grammar compilation timed out"
            return False
        try:
            compiled = self.future.result()
        except Exception as exc:  # noqa: BLE001 -- xgrammar's errors become the request's error
            self.error = f"grammar compilation failed: {xgrammar_message(exc)}"
            return False
        self._matcher = xgrammar_module().GrammarMatcher(compiled)
        return True

    @property
    def pending(self) -> bool:
        return self._matcher is None and self.error is None

    def fill_bitmask(self, bitmask: torch.Tensor, row: int) -> None:
        self._compiled().fill_next_token_bitmask(bitmask, row)

    def accept(self, token_id: int) -> bool:
        return self._compiled().accept_token(token_id)

    def _compiled(self) -> Any:
        """The matcher: the scheduler runs a request only once its grammar is ready."""
        if self._matcher is None:
            raise RuntimeError("the grammar is not compiled yet")
        return self._matcher

    def valid_prefix(self, drafts: list[int]) -> int:
        """How many leading speculative drafts the grammar allows (the matcher is left as it was)."""
        matcher, n = self._compiled(), 0
        for token in drafts:
            if matcher.is_terminated() or not matcher.accept_token(token):
                break
            n += 1
        if n:
            matcher.rollback(n)
        return n

    def fill_draft_bitmasks(self, bitmask: torch.Tensor, row: int, drafts: list[int]) -> None:
        """Rows row..row + len(drafts): the mask before each draft and after the last (drafts
        the grammar allows: see valid_prefix); the matcher is left as it was. A row after the
        grammar completed stays all-allowed: its token is never kept."""
        matcher = self._compiled()
        self.fill_bitmask(bitmask, row)
        for i, token in enumerate(drafts):
            matcher.accept_token(token)
            if not matcher.is_terminated():
                self.fill_bitmask(bitmask, row + i + 1)
        if drafts:
            matcher.rollback(len(drafts))

    @property
    def is_terminated(self) -> bool:
        return self._matcher is not None and self._matcher.is_terminated()


class StructuredOutputManager:
    """Compiles grammars on one background thread (tokenizer info built on first use) and
    fills the step's bitmask. Lives in the engine core; one per engine."""

    def __init__(
        self, model_dir: str, vocab_size: int, stop_token_ids: frozenset[int], timeout_s: float = COMPILE_TIMEOUT_S
    ) -> None:
        self.model_dir = model_dir
        self.vocab_size = vocab_size
        self.stop_token_ids = sorted(stop_token_ids)
        self.timeout_s = timeout_s
        # One thread (started on the first submit): compiles queue behind each other.
        self._executor = concurrent.futures.ThreadPoolExecutor(max_workers=1, thread_name_prefix="grammar")
        self._compiler = None
        self._compiler_lock = threading.Lock()
        self.in_use = False  # set by the first constrained request: steps look for grammars from then on

    def add_request(self, request: Request) -> None:
        params = request.sampling_params.structured_outputs
        if params is None:
            return
        self.in_use = True
        future = self._executor.submit(self._compile, params)
        request.grammar = GrammarState(future, time.monotonic() + self.timeout_s)

    def _compile(self, params: StructuredOutputsParams):
        compiler = self._get_compiler()
        if params.json is not None:
            return compiler.compile_json_schema(params.json, any_whitespace=False)
        if params.json_object:  # OpenAI's json_object: any JSON object (the builtin grammar allows arrays)
            return compiler.compile_json_schema(ANY_OBJECT_SCHEMA, any_whitespace=False, strict_mode=False)
        if params.regex is not None:
            return compiler.compile_regex(params.regex)
        if params.structural_tag is not None:
            return compiler.compile_structural_tag(params.structural_tag)
        return compiler.compile_grammar(params.choice_grammar() if params.choice is not None else params.grammar)

    def _get_compiler(self):
        with self._compiler_lock:
            if self._compiler is None:
                from pagedserve.engine.model.tokenizer import load_tokenizer

                xgr = xgrammar_module()
                # The generic fast tokenizer where it is the model's (~0.8 CPU-s against
                # AutoTokenizer's ~2.4 s in a worker, which loads no tokenizer otherwise).
                tokenizer = load_tokenizer(self.model_dir)
                info = xgr.TokenizerInfo.from_huggingface(
                    tokenizer, vocab_size=self.vocab_size, stop_token_ids=self.stop_token_ids or None
                )
                # One thread: the engine's matmuls own the cores.
                self._compiler = xgr.GrammarCompiler(info, max_threads=1)
            return self._compiler

    def wait_for_compiles(self, requests: Sequence[Request], timeout: float) -> None:
        """Block up to `timeout` for one of these requests' compiles (nothing else to run)."""
        futures = [r.grammar.future for r in requests if r.grammar is not None and r.grammar.pending]
        if futures:
            concurrent.futures.wait(futures, timeout=timeout, return_when=concurrent.futures.FIRST_COMPLETED)

    def bitmask(self, requests: Sequence[tuple[Request, list[int]]]) -> tuple[torch.Tensor, dict[str, int]] | None:
        """Rows for the constrained requests that sample this step, each with the speculative
        drafts it verifies (1 + len(drafts) rows: before each draft and after the last):
        (bitmask, first row of each)."""
        if not requests:
            return None
        bitmask = xgrammar_module().allocate_token_bitmask(sum(1 + len(d) for _, d in requests), self.vocab_size)
        rows, row = {}, 0
        for request, drafts in requests:
            grammar = request.grammar
            assert grammar is not None  # the caller passes constrained requests only
            if drafts:
                grammar.fill_draft_bitmasks(bitmask, row, drafts)
            else:
                grammar.fill_bitmask(bitmask, row)
            rows[request.request_id] = row
            row += 1 + len(drafts)
        return bitmask, rows

    def shutdown(self) -> None:
        self._executor.shutdown(wait=False, cancel_futures=True)


def apply_bitmask(logits: torch.Tensor, bitmask: torch.Tensor, rows: list[int]) -> None:
    """Forbid, in place, the tokens whose bit is 0 in `bitmask[i]` for logits row `rows[i]`."""
    xgr = xgrammar_module()
    full = torch.full((logits.shape[0], bitmask.shape[1]), -1, dtype=bitmask.dtype)
    full[rows] = bitmask
    xgr.apply_token_bitmask_inplace(logits, full.to(logits.device), vocab_size=logits.shape[1], indices=rows)
