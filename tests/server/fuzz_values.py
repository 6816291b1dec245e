"""Hypothesis strategies for the server fuzz (tests/server/app/test_fuzz.py): JSON bodies built from
the real field names of the declared request schemas, with hostile values.

Hostile values: integers past every bound (2^63, 2^64, 10^400), floats that are not finite
(`NaN`, `Infinity`, `1e999` as JSON tokens, "inf"/"nan" as strings), wrong types, objects and
arrays nested far past the 64-level limit, lone surrogates (`"\\ud800"`), long strings and
unknown fields. Bodies are written by `dump`, which, unlike `json.dumps`, takes `Raw` JSON text
anywhere (a value the json module cannot produce or would refuse to nest that deep).
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any
from urllib.parse import quote

import msgspec
from hypothesis import strategies as st

from pagedserve.engine.sampling.params import SamplingParams
from pagedserve.engine.structured_output.params import StructuredOutputsParams
from pagedserve.handlers.llm_input import ChatMessage, PredictionsBody
from pagedserve.handlers.openai_protocol import ChatBody, CompletionBody, StreamOptions
from pagedserve.server.anthropic import schemas as anthropic_schemas
from pagedserve.server.ollama import schemas as ollama_schemas
from pagedserve.server.vllm import routes as vllm_routes


@dataclass(frozen=True, slots=True)
class Raw:
    """JSON text put into a body as it is."""

    text: str


def dump(value: Any) -> str:
    """`value` as JSON text; `Raw` parts verbatim, strings escaped as `json.dumps` does (ASCII)."""
    if isinstance(value, Raw):
        return value.text
    if isinstance(value, dict):
        return "{" + ",".join(f"{json.dumps(str(k))}:{dump(v)}" for k, v in value.items()) + "}"
    if isinstance(value, (list, tuple)):
        return "[" + ",".join(dump(v) for v in value) + "]"
    return json.dumps(value)


def field_names(struct: type[msgspec.Struct]) -> list[str]:
    return [f.encode_name for f in msgspec.structs.fields(struct)]


SAMPLING = field_names(SamplingParams)
PREDICTIONS = sorted(set(field_names(PredictionsBody)) | set(SAMPLING))
COMPLETIONS = sorted(set(field_names(CompletionBody)) | set(SAMPLING))
CHAT = sorted(set(field_names(ChatBody)) | set(SAMPLING))
# The other APIs' bodies (issue 29): Ollama's, Anthropic's, vLLM's /tokenize.
OLLAMA_GENERATE = sorted(set(field_names(ollama_schemas.GenerateBody)) | {"options", "keep_alive"})
OLLAMA_CHAT = sorted(set(field_names(ollama_schemas.ChatBody)) | {"options", "keep_alive"})
OLLAMA_EMBED = field_names(ollama_schemas.EmbedBody)
ANTHROPIC = field_names(anthropic_schemas.MessagesBody)
TOKENIZE = field_names(vllm_routes.TokenizeBody)
CONSTRAINTS = field_names(StructuredOutputsParams)
MESSAGE = field_names(ChatMessage)


def _nested(depth: int, kind: str) -> Raw:
    if kind == "list":
        return Raw("[" * depth + "]" * depth)
    return Raw('{"a":' * depth + "1" + "}" * depth)


HUGE_INTS = [
    2**31,
    2**63 - 1,
    2**63,
    2**64 - 1,
    2**64,
    2**64 + 1,
    -(2**63) - 1,
    -(2**64),
    10**30,
    -1,
    0,
    Raw("1" + "0" * 400),
    Raw("-" + "9" * 5000),
]
ODD_FLOATS = [
    Raw("NaN"),
    Raw("Infinity"),
    Raw("-Infinity"),
    Raw("1e999"),
    Raw("-1e999"),
    Raw("1e-400"),
    1e-300,
    5e-324,
    1.7976931348623157e308,
    -0.0,
    0.5,
    1e20,
]
ODD_STRINGS = [
    "",
    "inf",
    "nan",
    "NaN",
    "Infinity",
    "-inf",
    "1e999",
    "true",
    "yes",
    "0x10",
    "1_0",
    "\x00",
    "null",
    "\u202e\u0000",
    "💥" * 100,
    "x" * 70_000,
    "\n" * 5000,
]
SURROGATES = [Raw('"\\ud800"'), Raw('"a\\udfffb"'), Raw('"\\udc00\\ud800"'), Raw('"\\ud83d"')]
WRONG_TYPES = [True, False, None, [], {}, [None], {"a": 1}, [[1, 2], [3]], {"": {"": []}}]
DEEP = [_nested(d, kind) for d in (65, 300, 1000, 20_000) for kind in ("list", "dict")]

hostile = st.one_of(
    st.sampled_from(HUGE_INTS),
    st.sampled_from(ODD_FLOATS),
    st.sampled_from(ODD_STRINGS),
    st.sampled_from(SURROGATES),
    st.sampled_from(WRONG_TYPES),
    st.sampled_from(DEEP),
    st.integers(),
    st.floats(allow_nan=False, allow_infinity=False),
    st.text(max_size=40),
    st.lists(st.integers(min_value=-5, max_value=60_000), max_size=8),
)
small_text = st.text(max_size=30)
some_text = st.text(min_size=1, max_size=30)
token_ids = st.lists(st.integers(min_value=0, max_value=49_151), min_size=1, max_size=12)
plain_schema = st.sampled_from(
    [
        {"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"]},
        {"type": "string", "maxLength": 3},
        {"enum": ["x", "y"]},
        {"type": "array", "items": {}},
    ]
)

# Values that pass the field's own check (or nearly), so a body gets past its first refusal and
# reaches the deeper checks, the tokenizer and the engine.
PLAUSIBLE: dict[str, st.SearchStrategy] = {
    "prompt": st.one_of(some_text, some_text, token_ids, st.lists(some_text, min_size=1, max_size=3)),
    "messages": st.lists(
        st.fixed_dictionaries(
            {
                "role": st.sampled_from(["system", "developer", "user", "user", "assistant", "tool"]),
                "content": st.one_of(
                    some_text,
                    some_text,
                    st.lists(
                        st.fixed_dictionaries(
                            {"type": st.sampled_from(["text", "text", "image_url"]), "text": small_text}
                        ),
                        max_size=2,
                    ),
                ),
            },
            optional={k: some_text for k in MESSAGE if k not in ("role", "content")},
        ),
        min_size=1,
        max_size=3,
    ),
    "model": st.sampled_from(["fuzz"] * 6 + ["fuzz@1.0", "fuzz@9", "nope", "@", "fuzz@"]),
    "stream": st.booleans(),
    "stream_options": st.fixed_dictionaries({}, optional={k: st.booleans() for k in field_names(StreamOptions)}),
    "n": st.integers(min_value=0, max_value=40),
    "max_tokens": st.integers(min_value=0, max_value=300),
    "max_completion_tokens": st.integers(min_value=0, max_value=300),
    "min_tokens": st.integers(min_value=0, max_value=20),
    "temperature": st.floats(min_value=0, max_value=3),
    "top_p": st.floats(min_value=0, max_value=1),
    "top_k": st.integers(min_value=-2, max_value=100),
    "min_p": st.floats(min_value=0, max_value=1),
    "seed": st.integers(min_value=-(2**63), max_value=2**64 - 1),
    "logprobs": st.one_of(st.booleans(), st.integers(min_value=0, max_value=21)),
    "top_logprobs": st.integers(min_value=0, max_value=21),
    "stop": st.one_of(small_text, st.lists(small_text, max_size=70)),
    "stop_token_ids": st.lists(st.integers(min_value=-1, max_value=60_000), max_size=70),
    "structured_outputs": st.fixed_dictionaries(
        {},
        optional={
            "json": plain_schema,
            "json_object": st.booleans(),
            "regex": st.sampled_from(["[ab]+", "(", "a{2,3}"]),
            "choice": st.lists(small_text, max_size=4),
            "grammar": st.sampled_from(['root ::= "a"', "root ::="]),
        },
    ),
    "response_format": st.sampled_from(
        [
            {"type": "text"},
            {"type": "json_object"},
            {"type": "xml"},
            {"type": "json_schema", "json_schema": {"name": "p", "schema": {"type": "integer"}}},
            {"type": "json_schema", "json_schema": {"schema": "not a schema"}},
        ]
    ),
    "guided_json": plain_schema,
    "guided_regex": st.sampled_from(["[0-9]", "(((", ""]),
    "guided_choice": st.lists(small_text, max_size=3),
    "guided_grammar": st.sampled_from(['root ::= "b"', "x"]),
}


def field_value(name: str) -> st.SearchStrategy:
    """A plausible value for the field (booleans and small integers for the rest)."""
    return PLAUSIBLE.get(name, st.one_of(st.booleans(), st.integers(min_value=-3, max_value=40)))


def body(fields: list[str], required: dict[str, st.SearchStrategy]) -> st.SearchStrategy:
    """A JSON object (a dict for `dump`): the `required` fields and a few of `fields` with
    plausible values; then, in most bodies, one field hostile, a required one missing or an
    unknown one added (the rest are well-formed and reach the engine)."""
    chosen = st.lists(st.sampled_from(fields), max_size=4, unique=True)

    @st.composite
    def build(draw) -> dict[str, Any]:
        out = {name: draw(strategy) for name, strategy in required.items()}
        for name in draw(chosen):
            out[name] = draw(field_value(name))
        if "max_tokens" not in out and draw(st.booleans()):
            out["max_tokens"] = draw(st.integers(1, 8))  # keep most generations short
        mode = draw(st.integers(0, 9))
        if mode in (4, 5, 6, 7):
            out[draw(st.sampled_from([*required, *fields]))] = draw(hostile)
        elif mode == 8 and required:
            out.pop(draw(st.sampled_from(list(required))))
        elif mode == 9:
            out[draw(st.sampled_from(["foo", "", "\ud800", "prompt ", "x" * 300]))] = draw(hostile)
        return out

    return build()


def whole_body() -> st.SearchStrategy:
    """A body that is not a JSON object at all."""
    return st.one_of(
        st.sampled_from(
            [
                b"",
                b"null",
                b"[]",
                b"1",
                b'"x"',
                b"{",
                b'{"prompt": }',
                b"\xff\xfe\x00",
                b'{"prompt": "a", "prompt": "b"}',
                b"{}" * 1000,
                b"\x1f\x8b\x08\x00junk",
            ]
        ),
        st.sampled_from(DEEP).map(lambda r: r.text.encode()),
        st.binary(max_size=64),
    )


ODD_SEGMENTS = [
    "",
    ".",
    "..",
    "%2e%2e",
    "%00",
    "a%2Fb",
    "x" * 5000,
    "\ud800",
    "💥",
    " ",
    "?",
    "#",
    "fuzz;v=1",
    "FUZZ",
    "fuzz\n",
    "%",
    "1.0",
    "all",
    "v1",
    "models",
]


def path_segment() -> st.SearchStrategy:
    """A path segment, percent-encoded as a client would send it."""
    raw = st.one_of(st.sampled_from(ODD_SEGMENTS), st.text(max_size=20))
    return raw.map(lambda s: quote(s.encode("utf-8", "surrogatepass"), safe=""))
