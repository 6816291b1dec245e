"""Sampler, sampling metadata and logits processors on tiny vocabularies."""

from __future__ import annotations

import pytest
import torch

from pagedserve.engine.sampling.logits_processors import apply_penalties
from pagedserve.engine.sampling.metadata import SamplingMetadata
from pagedserve.engine.sampling.params import SamplingParams
from pagedserve.engine.sampling.sampler import Sampler, apply_min_p, apply_top_k_top_p

EOS = 7
VOCAB = 8


def make_meta(params, outputs=None, prompts=None, generators=None, vocab_size=VOCAB):
    n = len(params)
    return SamplingMetadata.build(
        params,
        prompt_token_ids=prompts or [[1, 2]] * n,
        output_token_ids=outputs or [[]] * n,
        generators=generators or [None] * n,
        eos_token_ids={EOS},
        vocab_size=vocab_size,
        device="cpu",
    )


def seeded(seed: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


def random_logits(n: int, vocab_size: int = VOCAB, seed: int = 0) -> torch.Tensor:
    return torch.randn(n, vocab_size, generator=seeded(seed))


GREEDY = SamplingParams(temperature=0.0)
RANDOM = SamplingParams(temperature=1.0)


def test_greedy_rows_are_argmax_in_mixed_batch():
    logits = random_logits(6)
    params = [GREEDY, RANDOM, GREEDY, SamplingParams(temperature=2.0, top_k=3), GREEDY, RANDOM]
    out = Sampler()(logits, make_meta(params, generators=[seeded(i) for i in range(6)]))
    argmax = logits.argmax(dim=-1)
    assert out.sampled_token_ids.dtype == torch.int64
    assert out.sampled_token_ids[[0, 2, 4]].tolist() == argmax[[0, 2, 4]].tolist()
    assert out.logprobs is None
    assert Sampler()(logits, make_meta([GREEDY] * 6)).sampled_token_ids.tolist() == argmax.tolist()


def test_temperature_near_zero_is_greedy_and_random_rows_vary():
    logits = torch.tensor([[1.0, 1.0 + 1e-4, 0.9, 0.8]] * 64)
    params = [SamplingParams(temperature=1e-6)] * 32 + [RANDOM] * 32
    meta = make_meta(params, generators=[seeded(i) for i in range(64)], vocab_size=4)
    assert meta.greedy_mask.tolist() == [True] * 32 + [False] * 32
    sampled = Sampler()(logits, meta).sampled_token_ids
    assert sampled[:32].tolist() == [1] * 32
    assert len(set(sampled[32:].tolist())) > 1


def test_input_logits_are_not_modified():
    logits = random_logits(3)
    before = logits.clone()
    params = [
        SamplingParams(
            temperature=0.7, top_k=2, top_p=0.9, min_p=0.1, min_tokens=2, repetition_penalty=1.5, logprobs=1
        ),
        SamplingParams(temperature=0.0, presence_penalty=1.0),
        RANDOM,
    ]
    Sampler()(logits, make_meta(params, outputs=[[3], [3, 4], []]))
    assert torch.equal(logits, before)


def test_top_k_one_and_tiny_top_p_equal_greedy():
    logits = random_logits(16, seed=1)
    params = [SamplingParams(top_k=1)] * 8 + [SamplingParams(top_p=1e-6)] * 8
    for step in range(5):
        meta = make_meta(params, generators=[seeded(step * 16 + i) for i in range(16)])
        assert Sampler()(logits, meta).sampled_token_ids.tolist() == logits.argmax(-1).tolist()


def test_top_k_top_p_masks_exactly():
    probs = torch.tensor([[0.15, 0.5, 0.05, 0.3]] * 4)
    logits = probs.log()
    top_k = torch.tensor([2, 4, 4, 1])
    top_p = torch.tensor([1.0, 0.6, 0.85, 1.0])
    kept = apply_top_k_top_p(logits, top_k, top_p).isfinite().tolist()
    assert kept == [
        [False, True, False, True],  # top-2
        [False, True, False, True],  # 0.5 + 0.3 >= 0.6
        [True, True, False, True],  # 0.5 + 0.3 + 0.15 >= 0.85
        [False, True, False, False],  # top-1
    ]
    kept_k_only = apply_top_k_top_p(logits, top_k, None).isfinite().tolist()
    assert kept_k_only == [kept[0], [True] * 4, [True] * 4, kept[3]]
    # Surviving logits keep their values.
    assert apply_top_k_top_p(logits, top_k, top_p)[0, 1].item() == logits[0, 1].item()


def test_min_p_filters_below_scaled_top_probability():
    logits = torch.tensor([[0.5, 0.3, 0.15, 0.05]]).log()
    kept = apply_min_p(logits, torch.tensor([0.4])).isfinite().tolist()  # threshold 0.2
    assert kept == [[True, True, False, False]]
    params = [SamplingParams(min_p=0.4)] * 400
    meta = make_meta(params, generators=[seeded(0)] * 400, vocab_size=4)
    sampled = Sampler()(logits.expand(400, 4).contiguous(), meta).sampled_token_ids
    assert set(sampled.tolist()) == {0, 1}


def test_seeded_rows_reproducible_regardless_of_batch():
    steps = [random_logits(5, seed=100 + s) for s in range(12)]

    def run(position: int, batch: int, other_seed: int) -> list[int]:
        gen = seeded(1234)
        others = [seeded(other_seed + i) for i in range(batch)]
        tokens = []
        for logits in steps:
            rows = logits[:batch].clone()
            rows[position] = logits[0]
            params = [RANDOM] * batch
            if batch > 1:
                params[(position + 1) % batch] = GREEDY
            gens = [others[i] if i % 2 else None for i in range(batch)]
            gens[position] = gen
            out = Sampler()(rows, make_meta(params, generators=gens)).sampled_token_ids
            tokens.append(out[position].item())
        return tokens

    alone = run(0, 1, 0)
    assert len(set(alone)) > 1
    assert run(3, 5, 0) == alone
    assert run(1, 4, 99) == alone


@pytest.mark.parametrize("temperature", [1.0, 0.5])
def test_sampling_distribution_matches_softmax(temperature):
    probs = torch.tensor([0.1, 0.2, 0.3, 0.4])
    n = 4000
    params = [SamplingParams(temperature=temperature)] * n
    meta = make_meta(params, generators=[seeded(42)] * n, vocab_size=4)
    sampled = Sampler()(probs.log().expand(n, 4).contiguous(), meta).sampled_token_ids
    freq = torch.bincount(sampled, minlength=4).float() / n
    expected = (probs.log() / temperature).softmax(-1)
    assert (freq - expected).abs().max().item() < 0.03  # ~4 sigma; fixed seed, cannot flake


def test_penalties_exact_values():
    logits = torch.tensor([[2.0, -1.0, 0.5, -0.5, 3.0, 0.0]] * 2)
    params = [
        SamplingParams(repetition_penalty=2.0, presence_penalty=0.5, frequency_penalty=0.25),
        SamplingParams(),
    ]
    outputs = [[1, 2, 2], [4]]
    meta = make_meta(params, outputs=outputs, prompts=[[0, 5], [4]], vocab_size=6)
    assert meta.prompt_token_ids.tolist() == [[0, 5], [6, 6]]  # no-penalty row is padding
    got = apply_penalties(
        logits,
        meta.prompt_token_ids,
        meta.output_token_ids,
        meta.presence_penalties,
        meta.frequency_penalties,
        meta.repetition_penalties,
    )
    # 0: prompt only -> 2/2; 1: once in output -> -1*2 - 0.25 - 0.5; 2: twice -> 0.5/2 - 0.5 - 0.5
    # 5: prompt, zero logit -> 0*2; presence and frequency ignore the prompt.
    assert got[0].tolist() == [1.0, -2.75, -0.75, -0.5, 3.0, 0.0]
    assert got[1].tolist() == logits[1].tolist()


def test_penalties_change_greedy_choice():
    logits = torch.tensor([[3.0, 2.9, 0.0, 0.0]])
    params = [SamplingParams(temperature=0.0, frequency_penalty=0.2)]
    out = Sampler()(logits, make_meta(params, outputs=[[0]], prompts=[[]], vocab_size=4))
    assert out.sampled_token_ids.tolist() == [1]


def test_min_tokens_suppresses_eos_and_stop_ids_until_reached():
    logits = torch.zeros(4, VOCAB)
    logits[:, EOS] = 5.0
    logits[:, 5] = 4.0
    logits[:, 2] = 3.0
    params = [
        SamplingParams(temperature=0.0, min_tokens=3, stop_token_ids=[5]),
        SamplingParams(temperature=0.0, min_tokens=3, stop_token_ids=[5]),
        SamplingParams(temperature=0.0, min_tokens=3, stop_token_ids=[5], ignore_eos=True),
        SamplingParams(temperature=0.0, stop_token_ids=[5]),
    ]
    meta = make_meta(params, outputs=[[1, 1], [1, 1, 1], [1], []])
    assert meta.min_tokens_suppress == {0: [5, EOS], 2: [5]}
    assert Sampler()(logits, meta).sampled_token_ids.tolist() == [2, EOS, EOS, EOS]


def test_logprobs_of_raw_logits_sampled_first_with_rank():
    logits = random_logits(3, seed=5)
    best = logits.argmax(-1)
    params = [
        SamplingParams(temperature=0.0, logprobs=2, min_tokens=1, stop_token_ids=[best[0].item()]),
        SamplingParams(temperature=0.0, logprobs=0, repetition_penalty=1.5),
        SamplingParams(temperature=0.0),
    ]
    out = Sampler()(logits, make_meta(params, outputs=[[], [3], []]))
    raw = torch.log_softmax(logits, dim=-1)
    sampled = out.sampled_token_ids
    lp = out.logprobs
    assert lp.token_ids.shape == lp.logprobs.shape == (3, 3)
    assert lp.token_ids[:, 0].tolist() == sampled.tolist()
    assert torch.equal(lp.logprobs[:, 0], raw.gather(1, sampled.unsqueeze(1)).squeeze(1))
    top = raw.topk(2, dim=-1)
    assert torch.equal(lp.token_ids[:, 1:], top.indices)
    assert torch.equal(lp.logprobs[:, 1:], top.values)
    # Row 0's best token was suppressed, so it sampled the runner-up: rank 2.
    assert sampled[0].item() == raw[0].argsort(descending=True)[1].item()
    expected_ranks = [(raw[i] >= raw[i, sampled[i]]).sum().item() for i in range(3)]
    assert lp.sampled_ranks.tolist() == expected_ranks
    assert lp.sampled_ranks[0].item() == 2 and lp.sampled_ranks[2].item() == 1


def test_metadata_skips_unused_tensors():
    meta = make_meta([SamplingParams(temperature=0.0, max_tokens=10)] * 64, generators=[seeded(0)] * 64)
    assert meta.all_greedy and not meta.all_random and meta.num_rows == 64
    for name in (
        "greedy_mask",
        "temperature",
        "top_k",
        "top_p",
        "min_p",
        "presence_penalties",
        "frequency_penalties",
        "repetition_penalties",
        "prompt_token_ids",
        "output_token_ids",
        "min_tokens_suppress",
        "max_num_logprobs",
    ):
        assert getattr(meta, name) is None, name
    assert meta.generators == {} and meta.no_penalties

    gen = seeded(3)
    params = [
        SamplingParams(temperature=0.0, top_k=2, top_p=0.5, seed=1),
        SamplingParams(top_k=2),
        SamplingParams(top_k=50, seed=3),
        RANDOM,
    ]
    meta = make_meta(params, generators=[seeded(1), None, gen, None])
    assert not meta.all_greedy and not meta.all_random
    assert meta.greedy_mask.tolist() == [True, False, False, False]
    assert meta.temperature.tolist() == [1.0, 1.0, 1.0, 1.0]
    assert meta.top_k.tolist() == [VOCAB, 2, VOCAB, VOCAB]  # greedy row neutral, 50 clamped
    assert meta.top_p is None and meta.min_p is None  # only the greedy row asked for top-p
    assert meta.generators == {2: gen}
    assert meta.no_penalties and meta.min_tokens_suppress is None
    assert make_meta([RANDOM, SamplingParams(logprobs=0)]).max_num_logprobs == 0


def test_metadata_rejects_mismatched_lengths():
    with pytest.raises(ValueError):
        SamplingMetadata.build([RANDOM], [[1]], [[], []], [None], {EOS}, VOCAB, "cpu")


def test_bfloat16_logits_greedy_fast_path_and_widening():
    logits = random_logits(6).to(torch.bfloat16)
    greedy = Sampler()(logits, make_meta([SamplingParams(temperature=0)] * 6))
    assert torch.equal(greedy.sampled_token_ids, logits.float().argmax(-1))
    # With logprobs (or any processing) the logits are widened to float32 first.
    out = Sampler()(logits, make_meta([SamplingParams(temperature=0, logprobs=2)] * 6))
    assert torch.equal(out.sampled_token_ids, logits.float().argmax(-1))
    assert out.logprobs.logprobs.dtype == torch.float32
    with pytest.raises(ValueError, match="floating point"):
        Sampler()(torch.zeros(6, VOCAB, dtype=torch.int64), make_meta([SamplingParams()] * 6))
