"""Each speculation method end to end: greedy tokens equal plain decoding on the default model
(float32; the draft model: the default model drafting for itself and a tiny random one), the output distribution of sampled requests equal plain decoding's (chi-square over
the tiny model's 64-token vocabulary, fixed seeds), and the adaptive choice turning drafts off
where they lose."""

from __future__ import annotations

import json

import pytest
import torch

from pagedserve.engine import LLM, SamplingParams
from pagedserve.engine.config.engine import EngineConfig
from pagedserve.engine.core.engine_core import EngineCore
from pagedserve.engine.request.request import Request
from pagedserve.engine.spec_decode.adaptive import PROBE_STEPS, AdaptiveSpeculation

METHODS = ["ngram", "suffix", "auto", "draft"]

REPEAT = (
    "Repeat this text exactly, but replace nine with eight:\n\nThe library opens at nine in the morning and "
    "closes at six in the evening. Members may borrow up to five books at a time for three weeks."
)
PROMPTS = [
    [{"role": "user", "content": REPEAT}],
    [{"role": "user", "content": "Count from 1 to 12, separated by commas."}],
    [{"role": "user", "content": "Why is the sky blue?"}],
]


JSON_PROMPT = [
    {
        "role": "user",
        "content": 'Reply with JSON like {"name": "Ann", "age": 30, "city": "Oslo"} '
        'for Bob, 41, from Rome. Then do the same for Eve, 25, from Lima.',
    }
]
SCHEMA = {
    "type": "object",
    "properties": {"name": {"type": "string"}, "age": {"type": "integer"}, "city": {"type": "string"}},
    "required": ["name", "age", "city"],
}
JSON_PARAMS = SamplingParams(max_tokens=40, temperature=0, structured_outputs={"json": SCHEMA})


@pytest.fixture(scope="module")
def plain_tokens(default_model_dir):
    """Plain decoding's greedy tokens for PROMPTS, then for JSON_PROMPT under its schema."""
    llm = LLM(default_model_dir, dtype="float32", kv_cache_memory="128MiB", max_model_len=512)
    params = SamplingParams(max_tokens=40, temperature=0)
    tokens = [o.outputs[0].token_ids for o in llm.chat(PROMPTS, params)]
    return [*tokens, llm.chat([JSON_PROMPT], JSON_PARAMS)[0].outputs[0].token_ids]


@pytest.fixture(scope="module")
def tiny_draft_dir(tmp_path_factory, default_model_dir):
    """A tiny random-weight Llama with the default model's vocabulary (a draft that is mostly wrong)."""
    import transformers

    path = tmp_path_factory.mktemp("tiny-draft")
    torch.manual_seed(0)
    vocab = json.loads((default_model_dir / "config.json").read_text())["vocab_size"]
    config = transformers.LlamaConfig(
        vocab_size=vocab,
        hidden_size=32,
        intermediate_size=48,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=512,
    )
    transformers.LlamaForCausalLM(config).save_pretrained(path)
    return path


@pytest.mark.parametrize("draft", ["itself", "tiny"])
def test_draft_model_greedy_tokens_equal_plain_decoding(default_model_dir, tiny_draft_dir, plain_tokens, draft):
    model = default_model_dir if draft == "itself" else tiny_draft_dir
    llm = LLM(
        default_model_dir,
        dtype="float32",
        kv_cache_memory="128MiB",
        max_model_len=512,
        speculative={"method": "draft", "draft_model": str(model), "num_speculative_tokens": 4},
    )
    got = llm.chat(PROMPTS, SamplingParams(max_tokens=40, temperature=0))
    assert [o.outputs[0].token_ids for o in got] == plain_tokens[:3]
    stats = llm.engine.make_stats()
    if draft == "itself":  # the same model drafts its own greedy tokens: all kept
        assert stats.spec_draft_tokens > 40 and stats.spec_accepted_tokens == stats.spec_draft_tokens
    else:
        assert stats.spec_draft_tokens > 40 and stats.spec_accepted_tokens < stats.spec_draft_tokens / 2
    runner = llm.engine.runner
    # the budget pays for both pools: fewer target blocks than without a draft model
    assert runner.num_blocks == (128 << 20) // (runner.bytes_per_block + runner.draft_bytes_per_block)
    assert llm.engine.drafter.draft_model.num_free_blocks == runner.num_blocks  # all given back


@pytest.mark.parametrize("method", ["suffix", "auto"])
def test_greedy_tokens_equal_plain_decoding(default_model_dir, plain_tokens, method):
    llm = LLM(
        default_model_dir,
        dtype="float32",
        kv_cache_memory="128MiB",
        max_model_len=512,
        speculative={"method": method, "num_speculative_tokens": 6},
    )
    params = SamplingParams(max_tokens=40, temperature=0)
    for _ in range(2):  # the second time the global trie knows the first outputs
        got = llm.chat(PROMPTS, params)
        assert [o.outputs[0].token_ids for o in got] == plain_tokens[:3]
    # structured output: drafts cut to what the grammar allows, verified under a mask per position
    before = llm.engine.make_stats().spec_draft_tokens
    out = llm.chat([JSON_PROMPT], JSON_PARAMS)[0].outputs[0]
    assert out.token_ids == plain_tokens[3] and json.loads(out.text)["name"]
    assert llm.engine.make_stats().spec_draft_tokens > before
    stats = llm.engine.make_stats()
    assert stats.spec_accepted_tokens > 20 and stats.spec_draft_tokens >= stats.spec_accepted_tokens
    assert 0 < stats.spec_suffix_global_tokens <= 6 * 40 and stats.spec_suffix_global_bytes > 0
    if method == "auto":
        assert stats.spec_requests_drafted > 0 and stats.spec_acceptance_rate is not None


# -- sampling: the distribution is that of plain decoding -----------------------------------------

NUM_SAMPLES = 3000
POSITIONS = 3


def chi_square_p(a: torch.Tensor, b: torch.Tensor) -> float:
    """Two-sample chi-square test of homogeneity over categories (counts `a`, `b`); categories
    with fewer than 10 samples in all are pooled into one. Returns the p-value."""
    small = (a + b) < 10
    a = torch.cat([a[~small], a[small].sum(0, keepdim=True)]).double()
    b = torch.cat([b[~small], b[small].sum(0, keepdim=True)]).double()
    keep = (a + b) > 0
    a, b = a[keep], b[keep]
    total = a + b
    ea, eb = total * a.sum() / total.sum(), total * b.sum() / total.sum()
    stat = (((a - ea) ** 2) / ea + ((b - eb) ** 2) / eb).sum()
    df = len(a) - 1
    return float(torch.special.gammaincc(torch.tensor(df / 2.0, dtype=torch.float64), stat / 2))


def run(engine: EngineCore, prompt: list[int], params: list[SamplingParams]) -> list[list[int]]:
    """Every request's output tokens, driving engine.step() to the end."""
    out: dict[str, list[int]] = {}
    for i, p in enumerate(params):
        engine.add_request(Request(f"r{i}", list(prompt), p))
        out[f"r{i}"] = []
    while engine.has_unfinished_requests():
        for o in engine.step():
            out[o.request_id].extend(o.new_token_ids)
    return list(out.values())


def sample_counts(model_dir, speculative, temperature=0.03) -> torch.Tensor:
    """Counts [POSITIONS, 64] of the tokens sampled at each of the first output positions."""
    engine = EngineCore(
        EngineConfig(str(model_dir), num_kv_blocks=1024, max_model_len=64, max_num_seqs=64, speculative=speculative)
    )
    greedy = run(engine, [1, 2, 3], [SamplingParams(max_tokens=6, temperature=0, ignore_eos=True)])[0]
    loop = [1, 2, 3, *greedy]
    prompt = loop * 2 + loop[:3]  # drafts propose the greedy continuation
    params = [
        SamplingParams(max_tokens=POSITIONS, temperature=temperature, seed=1000 + i, ignore_eos=True)
        for i in range(NUM_SAMPLES)
    ]
    counts = torch.zeros(POSITIONS, 64)
    for tokens in run(engine, prompt, params):
        for pos, token in enumerate(tokens):
            counts[pos, token] += 1
    if speculative is not None:
        stats = engine.make_stats()
        assert stats.spec_draft_tokens > NUM_SAMPLES / 4  # drafts were really verified
        assert 0 < stats.spec_accepted_tokens < stats.spec_draft_tokens  # kept and refused ones
    return counts


@pytest.fixture(scope="module")
def plain_counts(tiny_model_dir):
    return sample_counts(tiny_model_dir, None)


@pytest.mark.parametrize("method", METHODS)
def test_sampled_distribution_equals_plain_decoding(tiny_model_dir, plain_counts, method):
    options = (
        {"draft_model": str(tiny_model_dir)}
        if method == "draft"
        else {"prompt_lookup_min": 1, "suffix_spec_factor": 4.0}
    )
    spec = sample_counts(tiny_model_dir, {"method": method, "num_speculative_tokens": 3, **options})
    for pos in range(POSITIONS):
        assert chi_square_p(plain_counts[pos], spec[pos]) > 1e-3, pos


def test_the_chi_square_test_sees_a_different_distribution(tiny_model_dir, plain_counts):
    """The test above has power: a slightly different temperature is told apart."""
    other = sample_counts(tiny_model_dir, None, temperature=0.04)
    assert min(chi_square_p(plain_counts[pos], other[pos]) for pos in range(POSITIONS)) < 1e-3


# -- the adaptive choice ------------------------------------------------------------------------


def test_adaptive_drafts_where_verification_is_cheap_and_stops_where_it_loses():
    a = AdaptiveSpeculation(max_tokens=6)
    # batch 1: a step costs ~the same with 0..6 drafts (weights read once): c ~ 0.03
    for d in [0, 2, 0, 4, 0, 6, 0, 1, 3, 5]:
        a.observe_step(1, d, 0.030 + 0.001 * d)
    assert a.cost_ratio(1) == pytest.approx(1 / 30)
    for _ in range(5):
        a.observe_verification("r", 4, 3)  # 3 of 4 kept, then a refusal: alpha ~ 0.75
    assert a.num_drafts("r", 1) == 6  # 0.75^6 = 0.18 > 0.033: all of them
    # batch 32: each draft token costs as much as a sequence's token: c = 1, never worth it
    for d in [0, 8, 0, 16, 0, 4, 0, 12]:
        a.observe_step(32, d, 0.320 + 0.010 * d)
    assert a.cost_ratio(32) == pytest.approx(1.0)
    assert [a.num_drafts("r", 32) for _ in range(100)] == [0] * 100  # no probe at c = 1
    # batch 8 with c = 0.5: an accurate request drafts, a poor one probes now and then
    for d in [0, 8, 0, 4, 0, 2, 0, 6]:
        a.observe_step(8, d, 0.080 + 0.005 * d)
    for _ in range(5):
        a.observe_verification("poor", 3, 0)
    assert a.num_drafts("r", 8) == 2  # 0.75^2 = 0.56 > 0.5 > 0.75^3
    choices = [a.num_drafts("poor", 8) for _ in range(100)]
    assert choices.count(1) == 100 // int(PROBE_STEPS / 0.5) and set(choices) == {0, 1}


def test_adaptive_new_requests_get_a_try_and_requests_with_nothing_to_draft_stop_asking():
    a = AdaptiveSpeculation(max_tokens=6)
    for d in [0, 8, 0, 4, 0, 2, 0, 6]:
        a.observe_step(8, d, 0.080 + 0.005 * d)  # c = 0.5
    for _ in range(20):
        a.observe_verification("poor", 3, 0)  # all requests' rate falls far below c
    assert a.global_rate() < 0.1
    assert a.num_drafts("new", 8) == 1  # nothing of it verified yet: a first try (0.6 > 0.5)
    for _ in range(3):
        a.observe_proposal("new", drafted=False)  # the drafter had nothing for it
    assert a.num_drafts("new", 8) == 0  # p * alpha < c: not asked again (only probed)
    # One probe per step: a request due for one waits while another probes.
    due = [a.num_drafts("poor", 8, may_probe=False) for _ in range(200)]
    assert due == [0] * 200 and a.num_drafts("poor", 8) == 1 and a.probed
    # Too few steps with drafts at a batch size: its slope is not fitted (a prior stands in).
    for d in [0, 0, 0, 0, 0, 3]:
        a.observe_step(4, d, 0.040 + (0.5 if d else 0.0))  # one stalled step with drafts
    assert a.cost_ratio(4) < 1.0
