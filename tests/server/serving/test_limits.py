"""Front-end limits in-process (server/serving/limits.py, engine/structured_output/limits.py): constraint size
and nesting bounds, the grammar-check pool's share per client, queue bound and time limit, and
the prompt character bound, with the default model's real tokenizer.

The pool is exercised with a check that blocks until the test releases it (a stand-in for a
slow xgrammar parse), so which check runs, waits or is refused is decided by the pool's rules,
not by timing. The time limit is tested with checks that never end before it.
"""

from __future__ import annotations

import asyncio
import json
import threading

import pytest

from pagedserve.engine.structured_output.limits import (
    MAX_CHOICE_CHARS,
    MAX_GROUP_DEPTH,
    MAX_SCHEMA_DEPTH,
    ConstraintTooLarge,
    check_constraint_size,
)
from pagedserve.engine.structured_output.params import StructuredOutputsParams, check_grammar
from pagedserve.handlers.base_handler import HandlerError
from pagedserve.handlers.llm_input import PromptSpec
from pagedserve.server.serving.limits import GrammarChecks, LimitRefused, PromptBounds


def nested_array_schema(depth: int) -> dict:
    schema: dict = {"type": "integer"}
    for _ in range(depth):
        schema = {"type": "array", "items": schema}
    return schema


# -- constraint bounds ---------------------------------------------------------------------------


def test_deep_schema_is_refused_before_xgrammar_sees_it():
    """700 deep took xgrammar minutes; the bound refuses it at once and names the limit."""
    with pytest.raises(ConstraintTooLarge, match=f"nested 701 levels deep; at most {MAX_SCHEMA_DEPTH}"):
        check_grammar(StructuredOutputsParams(json=nested_array_schema(700)))
    check_grammar(StructuredOutputsParams(json=nested_array_schema(MAX_SCHEMA_DEPTH - 1)))  # parses


def test_brackets_inside_strings_do_not_count():
    schema = {"type": "object", "properties": {"[[[[{{{{" * 20: {"type": "string", "pattern": "[(]{3}"}}}
    check_constraint_size(StructuredOutputsParams(json=schema))


def test_regex_grammar_and_choice_bounds():
    deep = "(" * (MAX_GROUP_DEPTH + 1) + "a" + ")" * (MAX_GROUP_DEPTH + 1)
    with pytest.raises(ConstraintTooLarge, match=f"regex nests groups {MAX_GROUP_DEPTH + 1} deep"):
        check_constraint_size(StructuredOutputsParams(regex=deep))
    check_constraint_size(StructuredOutputsParams(regex=r"\(" * 100 + "[(((((]" * 100))  # literal
    with pytest.raises(ConstraintTooLarge, match="grammar nests groups"):
        check_constraint_size(StructuredOutputsParams(grammar="root ::= " + deep.replace("a", '"a"')))
    check_constraint_size(StructuredOutputsParams(grammar='root ::= "' + "(" * 200 + '"'))
    with pytest.raises(ConstraintTooLarge, match=f"at most {MAX_CHOICE_CHARS} are allowed"):
        check_constraint_size(StructuredOutputsParams(choice=["x" * 1000] * 66))


# -- the grammar-check pool ----------------------------------------------------------------------


class Blocking:
    """A check that blocks until released; records the order checks started in."""

    def __init__(self) -> None:
        self.release = threading.Event()
        self.started: list[str] = []
        self.lock = threading.Lock()

    def __call__(self, params: StructuredOutputsParams) -> None:
        with self.lock:
            self.started.append(params.regex)
        if params.regex.startswith("slow"):
            self.release.wait(30)


def regex(name: str) -> StructuredOutputsParams:
    return StructuredOutputsParams(regex=name)


async def until(predicate) -> None:
    while not predicate():
        await asyncio.sleep(0.01)


def test_one_client_cannot_hold_more_than_its_share():
    asyncio.run(_one_client_cannot_hold_more_than_its_share())


async def _one_client_cannot_hold_more_than_its_share():
    blocking = Blocking()
    checks = GrammarChecks(
        threads=2, per_client=1, per_client_admitted=3, max_admitted=16, timeout_s=60, check=blocking
    )
    try:
        a = [asyncio.create_task(checks.check("attacker", regex(f"slow{i}"))) for i in range(3)]
        await until(lambda: blocking.started == ["slow0"])
        # Its fourth check is refused; its second and third wait for its own share ...
        with pytest.raises(LimitRefused) as refused:
            await checks.check("attacker", regex("slow3"))
        assert refused.value.code == 429
        # ... so another client's check runs on the second thread and ends.
        await checks.check("someone else", regex("fast"))
        assert blocking.started == ["slow0", "fast"] and not any(t.done() for t in a)
        blocking.release.set()
        await asyncio.gather(*a)
        assert sorted(blocking.started) == ["fast", "slow0", "slow1", "slow2"]
        assert checks.admitted == 0
    finally:
        blocking.release.set()
        checks.shutdown()


def test_the_queue_is_bounded():
    asyncio.run(_the_queue_is_bounded())


async def _the_queue_is_bounded():
    blocking = Blocking()
    checks = GrammarChecks(
        threads=1, per_client=1, per_client_admitted=100, max_admitted=3, timeout_s=60, check=blocking
    )
    try:
        tasks = [asyncio.create_task(checks.check(f"c{i}", regex(f"slow{i}"))) for i in range(3)]
        await until(lambda: checks.admitted == 3)
        with pytest.raises(LimitRefused) as refused:
            await checks.check("late", regex("fast"))
        assert refused.value.code == 503 and refused.value.headers == {"Retry-After": "1"}
        blocking.release.set()
        await asyncio.gather(*tasks)
    finally:
        blocking.release.set()
        checks.shutdown()


def test_a_check_over_the_time_limit_is_refused_and_keeps_its_share_until_it_ends():
    asyncio.run(_a_check_over_the_time_limit_is_refused_and_keeps_its_share_until_it_ends())


async def _a_check_over_the_time_limit_is_refused_and_keeps_its_share_until_it_ends():
    blocking = Blocking()
    checks = GrammarChecks(
        threads=2, per_client=1, per_client_admitted=4, max_admitted=16, timeout_s=0.2, check=blocking
    )  # the blocked check never ends in time
    try:
        with pytest.raises(LimitRefused, match="took longer than 0.2 s to check") as refused:
            await checks.check("attacker", regex("slow0"))
        assert refused.value.code == 400
        # Its thread is still busy: the same client's next check waits out its time limit ...
        with pytest.raises(LimitRefused, match="busy") as busy:
            await checks.check("attacker", regex("fast"))
        assert busy.value.code == 503
        # ... while another client still gets the free thread.
        await checks.check("someone else", regex("fast"))
        blocking.release.set()
        await until(lambda: checks.admitted == 0)
        await checks.check("attacker", regex("fast"))
    finally:
        blocking.release.set()
        checks.shutdown()


def test_real_checks_through_the_pool():
    asyncio.run(_real_checks_through_the_pool())


async def _real_checks_through_the_pool():
    checks = GrammarChecks()
    try:
        await checks.check("c", StructuredOutputsParams(json={"type": "object"}))
        with pytest.raises(ValueError, match="invalid regex"):
            await checks.check("c", StructuredOutputsParams(regex="(unclosed"))
        with pytest.raises(ConstraintTooLarge):
            await checks.check("c", StructuredOutputsParams(json=json.dumps(nested_array_schema(900))))
        assert checks.admitted == 0
    finally:
        checks.shutdown()


# -- the prompt character bound ------------------------------------------------------------------


@pytest.fixture(scope="module")
def tokenizer():
    from pagedserve.engine.model.default_model import default_model_dir
    from pagedserve.engine.model.tokenizer import load_tokenizer

    try:
        return load_tokenizer(default_model_dir())
    except FileNotFoundError as exc:
        pytest.skip(str(exc))


def test_prompt_that_cannot_fit_is_refused_before_tokenizing(tokenizer):
    bounds = PromptBounds()
    per_token = bounds.max_token_chars(tokenizer)
    vocab_longest = max(len(t) for t in tokenizer.get_vocab())
    assert per_token == vocab_longest  # byte-level BPE, no normalizer: one char per byte
    limit = 2047 * per_token
    # The longest token repeated: exactly the most text that 2047 tokens can hold.
    longest = max(tokenizer.get_vocab(), key=len)
    text = tokenizer.convert_tokens_to_string([longest])
    assert len(tokenizer.encode(text * 4, add_special_tokens=False)) <= 4
    bounds.check_prompt_chars(tokenizer, PromptSpec(text="x" * limit), 2048)
    with pytest.raises(HandlerError, match=f"'prompt' has {limit + 1} characters") as exc:
        bounds.tokenize(tokenizer, PromptSpec(text="x" * (limit + 1)), 2048)
    assert exc.value.param == "prompt" and exc.value.code == 400
    messages = [{"role": "user", "content": "x" * limit}, {"role": "user", "content": "y"}]
    with pytest.raises(HandlerError, match="'messages' has") as exc:
        bounds.tokenize(tokenizer, PromptSpec(messages=messages), 2048)
    assert exc.value.param == "messages"
    # Unknown length (no worker yet) or token ids: nothing to bound here.
    bounds.check_prompt_chars(tokenizer, PromptSpec(text="x" * (limit + 1)), None)
    bounds.check_prompt_chars(tokenizer, PromptSpec(token_ids=[1] * 5000), 2048)
    assert bounds.tokenize(tokenizer, PromptSpec(text="1, 2, 3"), 2048)[1] == tokenizer.encode(
        "1, 2, 3", add_special_tokens=False
    )
