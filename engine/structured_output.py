"""Structured output through xgrammar: generation constrained to a JSON schema, any JSON
object, a regular expression, one of a list of strings, or an EBNF grammar.

- `StructuredOutputsParams` (on SamplingParams) says which constraint; `check_grammar` parses it
  without a tokenizer, so a bad schema is refused before the request reaches a worker.
- In the engine core, `StructuredOutputManager` compiles each request's grammar on a worker
  thread (asynchronously, cached by xgrammar, time-limited); the scheduler leaves a request
  waiting until its grammar is ready. Each step the manager fills one bitmask row per
  structured request that samples; the runner masks forbidden logits before sampling; each
  sampled token then advances the request's matcher. A request whose grammar is complete
  stops (finish reason "stop").
"""

from __future__ import annotations

import concurrent.futures
import json
import re
import threading
import time
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch

from engine.constraint_limits import check_constraint_size

if TYPE_CHECKING:
    from engine.request import Request

COMPILE_TIMEOUT_S = 30.0
ANY_OBJECT_SCHEMA = '{"type": "object"}'
_XGRAMMAR_PREFIX = re.compile(r"^\[[^\]]*\]\s*\S+:\d+:\s*")  # "[time] file.cc:123: " before messages


class GrammarError(ValueError):
    """A constraint xgrammar cannot parse or compile; the message says why."""


@dataclass(slots=True)
class StructuredOutputsParams:
    """Exactly one constraint. `json` is a JSON schema (an object, or its JSON text)."""

    json: str | dict | None = None
    json_object: bool = False
    regex: str | None = None
    choice: list[str] | None = None
    grammar: str | None = None  # EBNF (xgrammar's dialect, GBNF-like), with a `root` rule

    def __post_init__(self) -> None:
        if isinstance(self.json, dict):
            self.json = json.dumps(self.json)
        given = [name for name in ("json", "regex", "choice", "grammar") if getattr(self, name) is not None]
        if self.json_object:
            given.append("json_object")
        if len(given) != 1:
            raise ValueError("structured_outputs takes exactly one of json, json_object, regex, choice or "
                             f"grammar; got {', '.join(given) or 'none'}")
        if self.json is not None:
            if not isinstance(self.json, str):
                raise ValueError("a JSON schema must be an object or its JSON text")
            try:
                schema = json.loads(self.json)
            except json.JSONDecodeError as exc:
                raise ValueError(f"the JSON schema is not valid JSON: {exc}") from None
            if not isinstance(schema, (dict, bool)):
                raise ValueError("a JSON schema must be an object")
        for name in ("regex", "grammar"):
            value = getattr(self, name)
            if value is not None and (not isinstance(value, str) or not value):
                raise ValueError(f"structured output {name} must be a non-empty string")
        if self.choice is not None and (not isinstance(self.choice, list) or not self.choice
                                        or not all(isinstance(c, str) and c for c in self.choice)):
            raise ValueError("structured output choice must be a non-empty list of non-empty strings")

    @property
    def kind(self) -> str:
        for name in ("json", "regex", "choice", "grammar"):
            if getattr(self, name) is not None:
                return name
        return "json_object"

    def choice_grammar(self) -> str:
        """The EBNF grammar that matches exactly one of the choices."""
        return "root ::= " + " | ".join(json.dumps(c, ensure_ascii=False) for c in self.choice)


def _xgrammar():
    try:
        import xgrammar
    except ImportError as exc:  # pragma: no cover - xgrammar is a dependency
        raise GrammarError("structured output needs the xgrammar package") from exc
    return xgrammar


def _message(exc: Exception) -> str:
    return _XGRAMMAR_PREFIX.sub("", str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__)


def check_grammar(params: StructuredOutputsParams) -> None:
    """Parse the constraint without a tokenizer (about a millisecond); GrammarError if invalid,
    ConstraintTooLarge (a ValueError) if over a size or nesting bound (checked first)."""
    check_constraint_size(params)
    xgr = _xgrammar()
    try:
        if params.json is not None:
            xgr.Grammar.from_json_schema(params.json, any_whitespace=False)
        elif params.regex is not None:
            xgr.Grammar.from_regex(params.regex)
        elif params.choice is not None:
            xgr.Grammar.from_ebnf(params.choice_grammar())
        elif params.grammar is not None:
            xgr.Grammar.from_ebnf(params.grammar)
    except RuntimeError as exc:
        raise GrammarError(f"invalid {params.kind} constraint: {_message(exc)}") from None


class GrammarState:
    """One request's grammar: the compile in flight, then its matcher."""

    def __init__(self, future: concurrent.futures.Future, deadline: float) -> None:
        self.future = future
        self._deadline = deadline
        self._matcher = None
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
            self.error = f"grammar compilation failed: {_message(exc)}"
            return False
        self._matcher = _xgrammar().GrammarMatcher(compiled)
        return True

    @property
    def pending(self) -> bool:
        return self._matcher is None and self.error is None

    def fill_bitmask(self, bitmask: torch.Tensor, row: int) -> None:
        self._matcher.fill_next_token_bitmask(bitmask, row)

    def accept(self, token_id: int) -> bool:
        return self._matcher.accept_token(token_id)

    @property
    def is_terminated(self) -> bool:
        return self._matcher is not None and self._matcher.is_terminated()


class StructuredOutputManager:
    """Compiles grammars on one background thread (tokenizer info built on first use) and
    fills the step's bitmask. Lives in the engine core; one per engine."""

    def __init__(self, model_dir: str, vocab_size: int, stop_token_ids: frozenset[int],
                 timeout_s: float = COMPILE_TIMEOUT_S) -> None:
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
        return compiler.compile_grammar(params.choice_grammar() if params.choice is not None else params.grammar)

    def _get_compiler(self):
        with self._compiler_lock:
            if self._compiler is None:
                from transformers import AutoTokenizer

                xgr = _xgrammar()
                tokenizer = AutoTokenizer.from_pretrained(self.model_dir)
                info = xgr.TokenizerInfo.from_huggingface(
                    tokenizer, vocab_size=self.vocab_size, stop_token_ids=self.stop_token_ids or None)
                # One thread: the engine's matmuls own the cores.
                self._compiler = xgr.GrammarCompiler(info, max_threads=1)
            return self._compiler

    def wait_for_compiles(self, requests: list[Request], timeout: float) -> None:
        """Block up to `timeout` for one of these requests' compiles (nothing else to run)."""
        futures = [r.grammar.future for r in requests if r.grammar is not None and r.grammar.pending]
        if futures:
            concurrent.futures.wait(futures, timeout=timeout, return_when=concurrent.futures.FIRST_COMPLETED)

    def bitmask(self, requests: list[Request]) -> tuple[torch.Tensor, dict[str, int]] | None:
        """One row per constrained request that samples this step: (bitmask, row of each)."""
        if not requests:
            return None
        bitmask = _xgrammar().allocate_token_bitmask(len(requests), self.vocab_size)
        rows = {}
        for row, request in enumerate(requests):
            request.grammar.fill_bitmask(bitmask, row)
            rows[request.request_id] = row
        return bitmask, rows

    def shutdown(self) -> None:
        self._executor.shutdown(wait=False, cancel_futures=True)


def apply_bitmask(logits: torch.Tensor, bitmask: torch.Tensor, rows: list[int]) -> None:
    """Forbid, in place, the tokens whose bit is 0 in `bitmask[i]` for logits row `rows[i]`."""
    xgr = _xgrammar()
    full = torch.full((logits.shape[0], bitmask.shape[1]), -1, dtype=bitmask.dtype)
    full[rows] = bitmask
    xgr.apply_token_bitmask_inplace(logits, full.to(logits.device), vocab_size=logits.shape[1], indices=rows)


def structured_outputs_from_dict(value: Any) -> StructuredOutputsParams | None:
    """StructuredOutputsParams from a mapping (JSON bodies, msgspec); None stays None."""
    if value is None or isinstance(value, StructuredOutputsParams):
        return value
    if not isinstance(value, dict):
        raise ValueError("structured_outputs must be an object")
    unknown = set(value) - {"json", "json_object", "regex", "choice", "grammar"}
    if unknown:
        raise ValueError(f"structured_outputs has unknown field(s) {sorted(unknown)}")
    return StructuredOutputsParams(**value)
