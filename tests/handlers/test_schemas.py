"""Declared schemas: request bodies, the wire message and management parameters refuse bad
values with a 400 naming the field (issue 11 findings 3, 5, 8 and 12), and the front end and
the worker's decoder refuse the same values."""

from __future__ import annotations

import json

import msgspec
import pytest

from pagedserve.engine.config.schema import SchemaError
from pagedserve.engine.core.messages import EngineCoreRequest, make_input_decoder
from pagedserve.engine.sampling.params import MAX_N, MAX_STOP_CHARS, MAX_STOP_STRINGS, SamplingParams
from pagedserve.handlers.base_handler import HandlerError
from pagedserve.handlers.json_body import MAX_JSON_DEPTH, decode_json_body
from pagedserve.handlers.llm_input import parse_predictions_body
from pagedserve.handlers.openai_protocol import parse_chat_request, parse_completion_request
from pagedserve.server.workers.params import MAX_TIMEOUT_S, RegisterParams, ScaleParams, read_params

BIG = 2**64  # msgpack cannot carry it: it used to reach the encoder and answer 500
CHAT = [{"role": "user", "content": "hi"}]


def predictions(raw: bytes | str):
    return parse_predictions_body(decode_json_body(raw))


def refused(call, *args) -> HandlerError:
    with pytest.raises(HandlerError) as info:
        call(*args)
    assert info.value.code == 400, str(info.value)
    return info.value


# -- finding 3: a value the worker would drop is a 400 in the front end ----------------------


def test_a_string_for_a_boolean_is_refused_on_every_route():
    body = {"prompt": "x", "max_tokens": 2, "ignore_eos": "yes"}
    for call, extra in ((parse_predictions_body, {}), (parse_completion_request, {"model": "m"})):
        err = refused(call, {**body, **extra})
        assert err.param == "ignore_eos" and str(err) == 'ignore_eos: must be true or false, got "yes"'


# -- finding 5: numbers, nesting and surrogates answer 400, not 500 --------------------------


@pytest.mark.parametrize(
    "field, value",
    [
        ("seed", BIG),
        ("top_k", BIG),
        ("temperature", BIG),
        ("repetition_penalty", BIG),
        ("stop_token_ids", [BIG]),
        ("min_tokens", BIG),
        ("max_tokens", BIG),
        ("n", BIG),
        ("logprobs", BIG),
    ],
)
def test_integers_beyond_64_bits_name_the_field(field, value):
    raw = json.dumps({"prompt": "x", field: value})
    err = refused(predictions, raw)
    assert err.param.split("[")[0] == field and str(err).startswith(field), str(err)
    err = refused(parse_completion_request, {"model": "m", "prompt": "x", field: value})
    assert str(err).startswith(field), str(err)


def test_token_ids_beyond_32_bits_are_refused():
    err = refused(predictions, json.dumps({"prompt": [1, BIG]}))
    assert err.param == "prompt[1]"


@pytest.mark.parametrize(
    "body",
    [
        b'{"prompt": "x", "x": ' + b"[" * 5000 + b"]" * 5000 + b"}",  # beyond Python's recursion limit
        b'{"prompt": "x", "x": ' + b"[" * (MAX_JSON_DEPTH + 1) + b"]" * (MAX_JSON_DEPTH + 1) + b"}",
        b'{"prompt": "x", "structured_outputs": {"json": ' + b'{"items": ' * 200 + b"{}" + b"}" * 202,
    ],
)
def test_deeply_nested_json_is_a_400(body):
    err = refused(decode_json_body, body)
    assert "deep" in str(err)


def test_nesting_within_the_limit_is_accepted():
    depth = MAX_JSON_DEPTH - 1  # the body object itself is one level
    value = decode_json_body(b'{"x": ' + b"[" * depth + b"]" * depth + b"}")["x"]
    for _ in range(depth - 1):
        [value] = value
    assert value == []


@pytest.mark.parametrize(
    "raw, field",
    [
        (b'{"prompt": "a\\ud800b"}', "prompt"),
        (b'{"messages": [{"role": "user", "content": "\\udfff"}]}', "messages[0].content"),
        (
            b'{"messages": [{"role": "user", "content": [{"type": "text", "text": "\\ud83d"}]}]}',
            "messages[0].content[0].text",
        ),
    ],
)
def test_a_lone_surrogate_names_the_field(raw, field):
    err = refused(decode_json_body, raw)
    assert err.param == field and "lone surrogate" in str(err) and str(err).startswith(field)


def test_a_number_of_thousands_of_digits_is_a_400():
    """msgspec refuses it; the json module's second look raised a plain ValueError (a 500)."""
    err = refused(decode_json_body, b'{"seed": -' + b"9" * 5000 + b"}")
    assert "digits" in str(err)


def test_a_paired_surrogate_is_text():
    assert predictions(b'{"prompt": "\\ud83d\\ude00"}').prompt.text == "\U0001f600"


def test_a_body_over_the_size_limit_is_413_before_parsing():
    err = refused_code(413, decode_json_body, b'{"prompt": "' + b"x" * 100 + b'"}', 50)
    assert "at most 50" in str(err)


def refused_code(code, call, *args) -> HandlerError:
    with pytest.raises(HandlerError) as info:
        call(*args)
    assert info.value.code == code
    return info.value


@pytest.mark.parametrize(
    "query, field",
    [
        ({"url": "a.mar", "response_timeout": "99999999999"}, "response_timeout"),
        ({"url": "a.mar", "response_timeout": str(BIG)}, "response_timeout"),
        ({"url": "a.mar", "initial_workers": "1000000"}, "initial_workers"),
        ({"url": "a.mar", "batch_size": "4"}, "batch_size"),
    ],
)
def test_registration_bounds(query, field):
    with pytest.raises(SchemaError) as info:
        read_params(query, RegisterParams)
    assert info.value.field == field and str(info.value).startswith(field)


def test_scale_timeout_is_bounded():
    with pytest.raises(SchemaError, match=f"timeout: must be <= {MAX_TIMEOUT_S}"):
        read_params({"min_worker": "1", "timeout": "99999999999999"}, ScaleParams)
    assert read_params({"timeout": "-1", "synchronous": "true"}, ScaleParams).wait_s is None


# -- finding 8: worker counts and n ------------------------------------------------------------

# (min_worker above max_worker / maxWorkers: the registry's rule, for every caller —
# tests/server/workers/test_registry_hardening.py::test_worker_counts_stay_within_the_versions_maximum)


def test_n_has_the_same_bound_on_every_route():
    for call, body in (
        (parse_predictions_body, {"prompt": "x"}),
        (parse_completion_request, {"model": "m", "prompt": "x"}),
        (parse_chat_request, {"model": "m", "messages": CHAT}),
    ):
        assert str(refused(call, {**body, "n": 1000})) == f"n: must be <= {MAX_N}, got 1000"
        assert call({**body, "n": MAX_N}).params.n == MAX_N


# -- finding 12: non-finite and absurd numbers ------------------------------------------------


def test_temperature_infinity_and_tiny_repetition_penalty_are_refused():
    err = refused(predictions, json.dumps({"prompt": "x", "temperature": float("inf")}))  # Python writes Infinity
    assert err.param == "temperature" and "finite" in str(err)
    err = refused(predictions, json.dumps({"prompt": "x", "temperature": float("nan")}))
    assert err.param == "temperature"
    err = refused(predictions, b'{"prompt": "x", "repetition_penalty": 1e-300}')
    assert str(err) == "repetition_penalty: must be >= 0.01, got 1e-300"
    with pytest.raises(ValueError, match="temperature: must be <= 100"):
        SamplingParams(temperature=float("inf"))


def test_stop_strings_are_bounded_in_number_and_length():
    err = refused(parse_predictions_body, {"prompt": "x", "stop": ["ab"] * (MAX_STOP_STRINGS + 1)})
    assert str(err) == f"stop: must have at most {MAX_STOP_STRINGS} items, got {MAX_STOP_STRINGS + 1}"
    err = refused(parse_predictions_body, {"prompt": "x", "stop": ["x" * (MAX_STOP_CHARS + 1)]})
    assert err.param == "stop[0]"


# -- one declaration: the front end and the worker refuse the same values --------------------

BAD_SAMPLING = [
    ("ignore_eos", "yes"),
    ("temperature", float("inf")),
    ("repetition_penalty", 1e-300),
    ("n", 1000),
    ("top_k", 2**63),
    ("stop_token_ids", [2**40]),
    ("min_tokens", 2**40),
    ("max_tokens", 0),
    ("top_p", 0),
    ("stop", ["s"] * (MAX_STOP_STRINGS + 1)),
    ("logprobs", 21),
    ("skip_special_tokens", 1),
    ("structured_outputs", {"regex": "a", "choice": ["a"]}),
    ("structured_outputs", {"schema": {}}),
]


def _wire(sampling: dict) -> bytes:
    """An EngineCoreRequest as a front end would put it on the socket, with these fields."""
    return msgspec.msgpack.encode(
        {"type": "add", "request_id": "r", "prompt_token_ids": [1, 2], "sampling_params": sampling}
    )


@pytest.mark.parametrize("field, value", BAD_SAMPLING)
def test_front_end_and_worker_decoder_refuse_the_same_values(field, value):
    err = refused(parse_predictions_body, {"prompt": "x", field: value})
    assert err.param.split(".")[0].split("[")[0] == field
    with pytest.raises(msgspec.ValidationError, match=field):
        make_input_decoder().decode(_wire({field: value}))


def test_a_valid_request_crosses_the_wire_unchanged():
    parsed = parse_predictions_body(
        {
            "prompt": "x",
            "max_tokens": 3,
            "seed": 2**64 - 1,
            "stop": "END",
            "top_k": -1,
            "structured_outputs": {"json": {"type": "object"}},
        }
    )
    request = EngineCoreRequest("r", [1, 2], parsed.params)
    decoded = make_input_decoder().decode(msgspec.msgpack.encode(request))
    assert decoded == request and decoded.sampling_params.stop == ["END"] and decoded.sampling_params.top_k == 0


def test_the_error_format_names_field_value_and_bound():
    err = refused(parse_predictions_body, {"prompt": "x", "max_tokens": 0})
    assert str(err) == "max_tokens: must be >= 1, got 0" and err.param == "max_tokens"
    err = refused(parse_predictions_body, {"prompt": "x", "foo": 1})
    assert str(err) == "unknown field 'foo'" and err.param == "foo"
    err = refused(parse_chat_request, {"model": "m", "messages": CHAT, "tools": [{"type": "function"}]})
    assert str(err) == "tools[0].function: is required" and err.param == "tools[0].function"
    err = refused(parse_chat_request, {"model": "m", "messages": CHAT, "audio": {"voice": "x"}})
    assert err.param == "audio"  # OpenAI fields this server cannot honour are refused by name
