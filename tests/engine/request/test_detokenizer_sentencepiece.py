"""IncrementalDetokenizer with a sentencepiece-style tokenizer (Metaspace, as Llama 2 and
Mistral use): the decoder drops the space of a text's first "▁word", so the output must be
decoded in the prompt's context to keep the space it has in decode(prompt + output)."""

from __future__ import annotations

import pytest

from pagedserve.engine.request.detokenizer import IncrementalDetokenizer

CORPUS = [
    "Hello world, the capital of France is Paris.",
    "What is the capital of Italy? Rome is.",
    "Ünïcödé wörds and naïve cafés in Paris.",
] * 20


@pytest.fixture(scope="module")
def tokenizer():
    tokenizers = pytest.importorskip("tokenizers")
    transformers = pytest.importorskip("transformers")
    tok = tokenizers.Tokenizer(tokenizers.models.BPE(unk_token="<unk>", byte_fallback=True))
    tok.pre_tokenizer = tokenizers.pre_tokenizers.Metaspace()
    tok.decoder = tokenizers.decoders.Sequence([tokenizers.decoders.ByteFallback(), tokenizers.decoders.Metaspace()])
    bytes_ = [f"<0x{i:02X}>" for i in range(256)]
    trainer = tokenizers.trainers.BpeTrainer(vocab_size=400, special_tokens=["<unk>", "<s>", "</s>", *bytes_])
    tok.train_from_iterator(CORPUS, trainer)
    return transformers.PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<s>", eos_token="</s>")


def encode(tokenizer, text: str) -> list[int]:
    return tokenizer.encode(text, add_special_tokens=False)


def test_the_decoder_drops_a_leading_space(tokenizer):
    """The premise: decoded alone, the first token of ' Paris' ('▁Pa...') loses its space."""
    prompt = encode(tokenizer, "Hello")
    ids = encode(tokenizer, "Hello Paris")
    first = tokenizer.decode(ids[len(prompt) : len(prompt) + 1])
    assert first and not first.startswith(" ")
    assert tokenizer.decode(ids)[len(tokenizer.decode(prompt)) :] == " Paris"


@pytest.mark.parametrize(
    "prompt, output",
    [
        ("the capital of France is", " Paris."),
        ("What is the capital of Italy?", " Rome is."),
        ("Hello", " wörds and naïve cafés"),  # byte-fallback pieces for the accents
        ("x", " world"),  # a prompt shorter than the context window
    ],
)
def test_output_text_is_what_the_output_adds_to_the_prompt(tokenizer, prompt, output):
    prompt_ids = encode(tokenizer, prompt)
    full_ids = encode(tokenizer, prompt + output)
    assert full_ids[: len(prompt_ids)] == prompt_ids
    output_ids = full_ids[len(prompt_ids) :]
    detok = IncrementalDetokenizer(tokenizer, prompt_ids)
    deltas = []
    for token_id in output_ids:
        detok.update([token_id])
        deltas.append(detok.get_next_delta())
    detok.finish()
    deltas.append(detok.get_next_delta())
    expected = tokenizer.decode(full_ids)[len(tokenizer.decode(prompt_ids)) :]
    assert expected == output  # the tokenizer round-trips these texts
    assert detok.output_text == output and "".join(deltas) == output


def test_stop_string_right_after_the_prompt(tokenizer):
    prompt_ids = encode(tokenizer, "the capital of France is")
    output_ids = encode(tokenizer, "the capital of France is Paris.")[len(prompt_ids) :]
    detok = IncrementalDetokenizer(tokenizer, prompt_ids, stop=[" Par"])
    matched = None
    for token_id in output_ids:
        matched = detok.update([token_id])
        if matched:
            break
    assert matched == " Par" and detok.output_text == ""
