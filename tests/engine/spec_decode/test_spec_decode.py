"""Speculative decoding: the n-gram drafter, verification (greedy and rejection sampling), the
scheduler's bookkeeping step by step, and the real model decoding the same tokens with it."""

from __future__ import annotations

import pytest
import torch

from pagedserve.engine import LLM, SamplingParams
from pagedserve.engine.config.engine import EngineConfig
from pagedserve.engine.config.speculative import SpecMethod, SpeculativeConfig
from pagedserve.engine.request.request import FinishReason
from pagedserve.engine.scheduler.output import ModelRunnerOutput
from pagedserve.engine.spec_decode.ngram import NgramProposer, can_draft
from pagedserve.engine.spec_decode.rejection import rejection_sample, verify_greedy
from tests.engine.kv_helpers import make_request
from tests.engine.scheduler.test_scheduler import make_scheduler

# -- the drafter ------------------------------------------------------------------------------------


def test_ngram_proposals():
    p = NgramProposer(num_tokens=4, min_n=1, max_n=3)
    assert p.propose([1, 2, 3, 4, 5, 1, 2, 3]) == [4, 5, 1, 2]  # "1 2 3" came before: what followed
    assert p.propose([1, 2, 3, 4, 5, 1, 2, 3], max_tokens=2) == [4, 5]
    assert p.propose([9, 1, 8, 2, 9, 1, 7, 1]) == [7, 1]  # only "1" recurs: its most recent occurrence
    assert p.propose([5, 6, 5, 7, 5, 6]) == [5, 7, 5, 6]  # "5 6" beats "6": longer n first
    assert p.propose([1, 2, 3, 4]) == []  # nothing recurs
    assert p.propose([7, 7, 7, 7]) == [7]  # the most recent occurrence, cut at the end
    assert p.propose([1, 2, 1, 2], max_tokens=0) == []
    assert NgramProposer(4, min_n=2, max_n=3).propose([1, 2, 3, 1]) == []  # n=1 not allowed


def test_what_may_be_drafted():
    assert can_draft(SamplingParams(temperature=0.7, top_p=0.9, seed=3))
    assert can_draft(SamplingParams(structured_outputs={"json_object": True}))  # drafts checked by the grammar
    for params in (SamplingParams(logprobs=1), SamplingParams(presence_penalty=0.5), SamplingParams(min_tokens=2)):
        assert not can_draft(params)


def test_config():
    config = EngineConfig("m", speculative={"num_speculative_tokens": 3, "method": "auto"})
    assert config.speculative_config == SpeculativeConfig(num_speculative_tokens=3, method=SpecMethod.AUTO)
    assert config.speculative["method"] == "auto" and config.speculative["suffix_max_depth"] == 24
    assert SpeculativeConfig(method="suffix").method is SpecMethod.SUFFIX
    with pytest.raises(
        ValueError, match='^speculative.method: must be one of "ngram", "suffix", "draft", "auto", got "eagle"'
    ):
        SpeculativeConfig.from_options({"method": "eagle"})
    with pytest.raises(ValueError, match="^speculative: unknown field 'k'"):
        SpeculativeConfig.from_options({"k": 3})
    with pytest.raises(ValueError, match="^speculative.num_speculative_tokens: must be <= 32, got 33"):
        SpeculativeConfig.from_options({"num_speculative_tokens": 33})
    with pytest.raises(ValueError, match="^speculative.suffix_min_prob: must be <= 1.0, got 2"):
        SpeculativeConfig.from_options({"method": "suffix", "suffix_min_prob": 2})
    for options in ({"method": "draft"}, {"method": "suffix", "draft_model": "/models/small"}):
        with pytest.raises(ValueError, match="^speculative.draft_model: is required with method 'draft' and only"):
            SpeculativeConfig.from_options(options)
    assert SpeculativeConfig(method="draft", draft_model="/m").draft_model == "/m"
    with pytest.raises(ValueError, match="^prompt_lookup_min: 5 exceeds prompt_lookup_max=4"):
        SpeculativeConfig(prompt_lookup_min=5)
    with pytest.raises(ValueError, match="^num_speculative_tokens: must be >= 1, got 0"):
        SpeculativeConfig(num_speculative_tokens=0)


# -- verification -----------------------------------------------------------------------------------


def test_greedy_keeps_drafts_until_the_first_disagreement():
    assert verify_greedy([4, 5, 6, 7], [4, 5, 6]) == [4, 5, 6, 7]  # all kept, plus the bonus token
    assert verify_greedy([4, 9, 6, 7], [4, 5, 6]) == [4, 9]  # the target's token replaces draft 2
    assert verify_greedy([8, 5, 6, 7], [4, 5, 6]) == [8]


def test_rejection_sampling_keeps_the_target_distribution():
    """The first token out follows the target's distribution, whatever the draft."""
    target = torch.tensor([0.1, 0.6, 0.3, 0.0])
    probs = torch.stack([target, target])  # one draft: rows for it and for the bonus token
    g = torch.Generator().manual_seed(0)
    for draft in (0, 1, 3):
        counts = torch.zeros(4)
        for _ in range(4000):
            counts[rejection_sample(probs, [draft], g)[0]] += 1
        assert torch.allclose(counts / counts.sum(), target, atol=0.025), (draft, counts)


def test_rejection_sampling_certain_and_impossible_drafts():
    g = torch.Generator().manual_seed(1)
    sure = torch.tensor([[0.0, 1.0, 0.0], [0.0, 0.0, 1.0], [1.0, 0.0, 0.0]])
    assert rejection_sample(sure, [1, 2], g) == [1, 2, 0]
    assert rejection_sample(sure, [0, 2], g) == [1]  # p(draft) = 0: refused, the target's token instead


# -- the scheduler, step by step (block_size 4) ----------------------------------------------------


def test_drafts_are_scheduled_then_the_refused_ones_rolled_back():
    s = make_scheduler(budget=32)
    a = make_request(list(range(10)), request_id="a", max_tokens=20)
    s.add_request(a)
    out = s.schedule()
    s.update_from_output(out, ModelRunnerOutput({"a": [50]}))
    assert (a.num_tokens, a.num_computed_tokens) == (11, 10)
    a.spec_token_ids = [51, 52, 53]
    out = s.schedule()
    assert out.num_scheduled_tokens == {"a": 4} and out.scheduled_spec_tokens == {"a": [51, 52, 53]}
    assert a.num_computed_tokens == 14  # 10 + the newest token + 3 drafts, until verified
    assert s.kv.get_block_ids("a") == [0, 1, 2, 3]  # room for positions 10..13
    res = s.update_from_output(out, ModelRunnerOutput({"a": [51, 60]}))  # draft 1 kept, then 60
    assert res[0].new_token_ids == [51, 60]
    assert (a.num_tokens, a.num_computed_tokens, a.spec_token_ids) == (13, 12, [])
    assert (s.num_draft_tokens, s.num_accepted_tokens) == (3, 1)
    out = s.schedule()  # no drafts this time: plain decode of the newest token (60, position 12)
    assert out.num_scheduled_tokens == {"a": 1} and out.scheduled_spec_tokens == {}
    assert s.kv.get_block_ids("a") == [0, 1, 2, 3]  # the block for the refused drafts is reused


def test_the_budget_cuts_drafts():
    s = make_scheduler(budget=8)
    a = make_request(list(range(4)), request_id="a")
    b = make_request(list(range(20, 25)), request_id="b")
    s.add_request(a)
    out = s.schedule()
    s.update_from_output(out, ModelRunnerOutput({"a": [9]}))
    s.add_request(b)
    a.spec_token_ids = [1, 2, 3, 4, 5, 6, 7, 8]
    out = s.schedule()
    assert out.num_scheduled_tokens == {"a": 8} and out.scheduled_spec_tokens == {"a": [1, 2, 3, 4, 5, 6, 7]}
    assert [r.req_id for r in out.new_requests] == []  # b waits: nothing left of the budget


def test_a_stop_among_kept_tokens_ends_the_request_there():
    s = make_scheduler()
    a = make_request(list(range(6)), request_id="a", max_tokens=10, eos=frozenset({99}))
    s.add_request(a)
    out = s.schedule()
    s.update_from_output(out, ModelRunnerOutput({"a": [30]}))
    a.spec_token_ids = [31, 99, 33]
    out = s.schedule()
    res = s.update_from_output(out, ModelRunnerOutput({"a": [31, 99, 33, 34]}))
    assert res[0].new_token_ids == [31, 99] and res[0].finish_reason is FinishReason.STOP
    assert not s.has_unfinished_requests() and s.kv.pool.get_num_free_blocks() == 16


# -- the real model -------------------------------------------------------------------------------

REPEAT = (
    "Repeat this text exactly, but replace nine with eight:\n\nThe library opens at nine in the morning and "
    "closes at six in the evening. Members may borrow up to five books at a time for three weeks."
)
PROMPTS = [
    [{"role": "user", "content": REPEAT}],
    [{"role": "user", "content": "Count from 1 to 12, separated by commas."}],
    [{"role": "user", "content": "What is the capital of France?"}],
]


@pytest.fixture(scope="module")
def engines(default_model_dir):
    def make(speculative):
        return LLM(
            default_model_dir, dtype="float32", kv_cache_memory="128MiB", max_model_len=512, speculative=speculative
        )

    return make(None), make({"num_speculative_tokens": 4})


def test_greedy_tokens_equal_plain_decoding(engines):
    plain, spec = engines
    params = SamplingParams(max_tokens=40, temperature=0)
    logprobs = SamplingParams(max_tokens=12, temperature=0, logprobs=2)  # decodes one token at a time
    expected = [o.outputs[0].token_ids for o in plain.chat(PROMPTS, params)]
    expected.append(plain.chat([PROMPTS[1]], logprobs)[0].outputs[0].token_ids)
    got = spec.chat([*PROMPTS, PROMPTS[1]], [params] * 3 + [logprobs])
    assert [o.outputs[0].token_ids for o in got] == expected
    stats = spec.engine.make_stats()
    assert stats.spec_accepted_tokens > 10 and stats.spec_draft_tokens >= stats.spec_accepted_tokens
    assert len(got[3].outputs[0].logprobs) == 12


def test_seeded_sampling_is_reproducible(engines):
    _, spec = engines
    params = SamplingParams(max_tokens=24, temperature=0.8, seed=7)
    first = spec.chat([PROMPTS[0]], params)[0].outputs[0]
    again = spec.chat([PROMPTS[0]], params)[0].outputs[0]
    assert first.token_ids == again.token_ids and len(first.token_ids) > 0
