"""The offline API on the real default model: sampling features, stops, n, logprobs, chat, and
bad input refused with a clear exception and the engine left intact."""

from __future__ import annotations

import pytest

from pagedserve.engine import LLM, SamplingParams

pytestmark = pytest.mark.slow

COUNT = "1, 2, 3, 4,"


@pytest.fixture(scope="module")
def llm(default_model_dir):
    return LLM(default_model_dir, dtype="float32", kv_cache_memory="256MiB", max_model_len=2048)


def greedy(**kw) -> SamplingParams:
    return SamplingParams(temperature=0, **kw)


def assert_engine_idle(llm: LLM) -> None:
    engine = llm.engine
    assert not engine.has_unfinished_requests()
    assert engine.kv_manager.pool.get_num_free_blocks() == engine.runner.num_blocks


def test_text_and_token_prompts_keep_order(llm):
    ids = llm.tokenizer.encode(COUNT, add_special_tokens=False)
    outs = llm.generate([COUNT, ids, "The capital of Germany is"], greedy(max_tokens=8))
    assert [o.prompt for o in outs] == [COUNT, None, "The capital of Germany is"]
    assert outs[0].outputs[0].text.startswith(" 5, 6, 7")
    assert outs[0].outputs[0].token_ids == outs[1].outputs[0].token_ids
    assert all(o.finished and o.outputs[0].finish_reason == "length" for o in outs)
    assert all(len(o.outputs[0].token_ids) == 8 for o in outs)
    assert_engine_idle(llm)


def test_stop_string_is_truncated_and_reported(llm):
    (out,) = llm.generate(COUNT, greedy(max_tokens=16, stop=[" 7"]))
    c = out.outputs[0]
    assert c.text == " 5, 6," and c.finish_reason == "stop" and c.stop_reason == " 7"
    (out,) = llm.generate(COUNT, greedy(max_tokens=16, stop=[" 7"], include_stop_str_in_output=True))
    assert out.outputs[0].text == " 5, 6, 7"
    assert_engine_idle(llm)


def test_stop_token_id(llm):
    comma = llm.tokenizer.encode(",", add_special_tokens=False)[0]
    (out,) = llm.generate(COUNT, greedy(max_tokens=16, stop_token_ids=[comma]))
    c = out.outputs[0]
    assert c.finish_reason == "stop" and c.stop_reason == comma and c.token_ids[-1] == comma
    assert c.text == " 5,"


def test_chat_answers_and_stops_at_eos(llm):
    (out,) = llm.chat([{"role": "user", "content": "What is 2 plus 2?"}], greedy(max_tokens=40))
    c = out.outputs[0]
    assert "4" in c.text and c.finish_reason == "stop" and c.stop_reason is None
    # min_tokens keeps EOS away; ignore_eos runs to max_tokens.
    (out,) = llm.chat(
        [{"role": "user", "content": "What is 2 plus 2?"}], greedy(max_tokens=60, min_tokens=len(c.token_ids) + 5)
    )
    assert len(out.outputs[0].token_ids) >= len(c.token_ids) + 5
    (out,) = llm.chat([{"role": "user", "content": "What is 2 plus 2?"}], greedy(max_tokens=50, ignore_eos=True))
    assert len(out.outputs[0].token_ids) == 50 and out.outputs[0].finish_reason == "length"


def test_n_and_seed_are_reproducible(llm):
    params = SamplingParams(n=3, temperature=1.0, top_p=0.95, seed=7, max_tokens=12)
    first = llm.generate("Once upon a time", params)[0]
    second = llm.generate(["Hello", "Once upon a time"], params)[1]
    assert [c.index for c in first.outputs] == [0, 1, 2]
    assert [c.token_ids for c in first.outputs] == [c.token_ids for c in second.outputs]
    assert len({tuple(c.token_ids) for c in first.outputs}) > 1  # children differ
    assert_engine_idle(llm)


def test_logprobs(llm):
    (out,) = llm.generate(COUNT, greedy(max_tokens=4, logprobs=3))
    c = out.outputs[0]
    assert len(c.logprobs) == 4
    for token, entry in zip(c.token_ids, c.logprobs):
        assert token in entry and entry[token].rank == 1  # greedy picks the best
        assert 1 <= len(entry) <= 4
        best = max(entry.values(), key=lambda lp: lp.logprob)
        assert best is entry[token] and best.logprob <= 0
    assert c.logprobs[0][c.token_ids[0]].decoded_token == " "


def test_prefix_cache_hits_are_reported(llm):
    prompt = "Shared context. " * 20 + "Question: what comes next?"
    llm.generate(prompt, greedy(max_tokens=2))
    (out,) = llm.generate(prompt, greedy(max_tokens=2))
    assert out.num_cached_tokens >= 16 * (len(llm.tokenizer.encode(prompt)) // 16 - 1)


@pytest.mark.parametrize(
    "prompt, params, message",
    [
        ("", {}, "at least one token"),
        ([], {}, "at least one token"),
        ([10**6], {}, "out of range"),
        ([-1, 5], {}, "out of range"),
        ("x " * 3000, {}, "max_model_len"),
        (COUNT, {"max_tokens": 0}, "max_tokens"),
        (COUNT, {"top_p": 0.0}, "top_p"),
        (COUNT, {"top_p": 1.5}, "top_p"),
        (COUNT, {"temperature": -0.5}, "temperature"),
        (COUNT, {"top_k": -3}, "top_k"),
        (COUNT, {"n": 0}, "n: must be >= 1"),
    ],
)
def test_bad_input_is_refused_and_engine_stays_intact(llm, prompt, params, message):
    with pytest.raises(ValueError, match=message):
        llm.generate([COUNT, prompt], SamplingParams(**params) if params else greedy(max_tokens=2))
    assert_engine_idle(llm)
    (out,) = llm.generate(COUNT, greedy(max_tokens=3))
    assert out.outputs[0].text == " 5,"


def test_no_prompts_is_an_error(llm):
    with pytest.raises(ValueError):
        llm.generate([])
    with pytest.raises(ValueError, match="sampling params"):
        llm.generate([COUNT, COUNT], [greedy()])


def test_priority_is_validated(llm):
    with pytest.raises(ValueError, match="priority"):
        llm.generate([COUNT, COUNT], greedy(max_tokens=2), priority=[1])
    outs = llm.generate([COUNT, COUNT], greedy(max_tokens=3), priority=[1, 0])
    assert [o.outputs[0].text for o in outs] == [" 5,", " 5,"]


def test_embed_text_and_token_prompts(llm):
    ids = llm.tokenizer.encode(COUNT, add_special_tokens=False)
    text, tokens, other = llm.embed([COUNT, ids, "The capital of Germany is"])
    assert len(text) == llm.engine.hf_config["hidden_size"] and sum(x * x for x in text) == pytest.approx(1.0)
    assert text == pytest.approx(tokens, abs=1e-5)  # the same prompt as text or token ids
    assert sum(a * b for a, b in zip(text, other)) < 0.99  # a different prompt, a different vector
    assert_engine_idle(llm)
