"""logit_bias: the declaration's bounds, the logits processor's exact values, the sampler's use
of it (greedy and random rows), and the vocabulary check where a request enters."""

from __future__ import annotations

import pytest
import torch

from pagedserve.engine.config.schema import SchemaError
from pagedserve.engine.request.inputs import InputLimits, InvalidInput, validate_input
from pagedserve.engine.sampling.logits_processors import apply_logit_bias
from pagedserve.engine.sampling.params import MAX_LOGIT_BIAS, SamplingParams
from pagedserve.engine.sampling.sampler import Sampler
from tests.engine.sampling.test_sampler import make_meta, random_logits, seeded


def test_apply_logit_bias_adds_exact_values_per_row_and_leaves_input_unchanged():
    logits = torch.zeros(3, 5)
    out = apply_logit_bias(logits, {0: {1: 2.5, 4: -100.0}, 2: {0: 1.0}})
    expected = torch.zeros(3, 5)
    expected[0, 1], expected[0, 4], expected[2, 0] = 2.5, -100.0, 1.0
    assert torch.equal(out, expected) and torch.equal(logits, torch.zeros(3, 5))
    assert apply_logit_bias(logits, None) is logits


def test_bias_steers_greedy_and_bans_tokens_for_random_rows():
    logits = random_logits(2)
    plain = Sampler()(logits, make_meta([SamplingParams(temperature=0.0)] * 2)).sampled_token_ids
    target = (int(plain[0]) + 1) % logits.shape[1]
    forced = SamplingParams(temperature=0.0, logit_bias={target: 100.0})
    out = Sampler()(logits, make_meta([forced, SamplingParams(temperature=0.0)])).sampled_token_ids
    assert out.tolist() == [target, int(plain[1])]  # only the biased row changes
    banned = SamplingParams(temperature=1.0, logit_bias={t: -100.0 for t in range(1, 8)})
    draws = Sampler()(random_logits(64), make_meta([banned] * 64, generators=[seeded(i) for i in range(64)]))
    assert set(draws.sampled_token_ids.tolist()) == {0}


@pytest.mark.parametrize(
    "bias, field",
    [
        ({1: 101.0}, "logit_bias"),
        ({1: -100.5}, "logit_bias"),
        ({-1: 1.0}, "logit_bias"),
        ({i: 1.0 for i in range(MAX_LOGIT_BIAS + 1)}, "logit_bias"),
    ],
)
def test_bounds_refused_naming_the_field(bias, field):
    with pytest.raises(SchemaError) as err:
        SamplingParams(logit_bias=bias)
    assert field in str(err.value)


def test_ids_outside_the_vocabulary_refused_where_the_request_enters():
    limits = InputLimits(max_model_len=64, vocab_size=8)
    validate_input([1, 2], SamplingParams(logit_bias={7: 1.0}), limits)
    with pytest.raises(InvalidInput) as err:
        validate_input([1, 2], SamplingParams(logit_bias={8: 1.0}), limits)
    assert err.value.field == "logit_bias" and "8" in str(err.value)
