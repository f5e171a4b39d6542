"""A number in a JSON schema that the grammar compiler would change is refused naming it and where it is.

The compiler (llguidance 1.9) reads every number as a 64-bit float: an ``enum`` of 9007199254740993
produced 9007199254740992, a ``const`` of 2^64-1 produced 18446744073709552000, an integer-typed
``enum`` of 1e19 produced 9223372036854775807, each with ``finish_reason: "stop"``; an integer
schema's ``enum`` or ``const`` near -2^63, written as an integer or as a float (``-1e19``), crashed
the process (a segmentation fault) with one request.
"""

from __future__ import annotations

import pytest

from lightllm.server.http.errors import APIError
from lightllm.server.http.structured.response_format import compile_json_schema, inexact_number


@pytest.mark.parametrize(("schema", "path", "number"), [
    ({"type": "integer", "minimum": 10**20, "maximum": 10**20 + 5}, "minimum", 10**20),
    ({"properties": {"x": {"enum": [1, -(2**63) - 1]}}}, "properties.x.enum.1", -(2**63) - 1),
    ({"const": -(2**63) + 1}, "const", -(2**63) + 1),
    ({"enum": [2**53 + 1]}, "enum.0", 2**53 + 1),
    ({"anyOf": [{"const": 2**64 - 1}]}, "anyOf.0.const", 2**64 - 1),
    # Floats: the fuzzer's crashes, and a clamped one.
    ({"type": "integer", "enum": [-1e19]}, "enum.0", -1e19),
    ({"type": "integer", "const": -9223372036854775808.0}, "const", -9223372036854775808.0),
    ({"type": ["integer", "string"], "enum": [-9.3e18]}, "enum.0", -9.3e18),
    ({"type": "integer", "enum": [1e300]}, "enum.0", 1e300),
    ({"type": "integer", "minimum": -(2**63), "maximum": 2**63 - 1}, "minimum", -(2**63)),
])
def test_a_number_the_compiler_would_change_is_refused_with_its_place(schema, path, number) -> None:
    assert inexact_number(schema)[:2] == (path, number)
    with pytest.raises(APIError) as refused:
        compile_json_schema(schema, "response_format")
    assert refused.value.param == "response_format"
    assert f"the number {number!r} at '{path}' is beyond what the grammar compiler keeps (" in \
        refused.value.message


def test_numbers_within_2_to_the_53_and_booleans_pass() -> None:
    # Bounds only need to be readable: int64 bounds (OpenAPI's, protobuf's) compile.
    for schema in ({"enum": [-(2**53), 2**53, 0.1, -1.5e15]}, {"const": True}, {"type": "number", "maximum": 1e15},
                   {"type": "integer", "minimum": 0, "maximum": 2**63 - 1},
                   # A property named like a keyword is a name, not an enum or const.
                   {"properties": {"const": {"type": "integer", "maximum": 2**63 - 1}}}):
        assert inexact_number(schema) is None
        compile_json_schema(schema, "response_format")


@pytest.mark.parametrize("grammar", ['start: %json {"enum": [-9223372036854775807]}',
                                     'start: "a" | %json {"properties": {"x": {"const": -9223372036854775800}}}',
                                     'start: %json {"type": "integer", "enum": [-1e19]}',
                                     'start: %json {"type": "integer", "const": -9.3E+18}',
                                     'start: %json {"type": "integer", "const": -9223372036854775808.0}'])
def test_a_lark_grammar_embedding_such_a_number_is_refused_before_the_compiler_sees_it(grammar) -> None:
    # One /v1/completions request with this guided_grammar ended the whole server (no answer, the
    # health port gone, shared memory left behind).
    from lightllm.server.http.structured.structured_params import structured_grammar

    with pytest.raises(APIError) as refused:
        structured_grammar(None, {"guided_grammar": grammar})
    assert "below what the grammar compiler is given (-2^62)" in refused.value.message


def test_a_lark_grammar_with_ordinary_negative_numbers_compiles() -> None:
    from lightllm.server.http.structured.structured_params import structured_grammar

    assert structured_grammar(None, {"guided_grammar": 'start: %json {"type": "integer", "minimum": -1e15}'})


@pytest.mark.parametrize("fields", [
    {"guided_choice": ["123e4567-4e50-41d4-a716-446655440000", "other"]},
    {"guided_regex": "SKU-1e20-[0-9]{4}"},
    {"guided_json": {"type": "string", "enum": ["123e4567-4e50-41d4-a716-446655440000"]}},
    {"guided_grammar": 'start: "id-4e50-x" | "ab-9e30"'},
])
def test_text_that_merely_looks_like_a_negative_number_is_not_refused(fields) -> None:
    # A UUID's "-4e50" read as -4e50 refused about one random UUID in twenty.
    from lightllm.server.http.structured.structured_params import structured_grammar

    assert structured_grammar(None, fields)


def test_annotations_hold_any_float() -> None:
    # default and examples are not compiled (llguidance ignores them), but it must still read an
    # integer there: beyond 64 bits it fails ("Value is not JSON serializable").
    assert inexact_number({"examples": [10**25]})[:2] == ("examples.0", 10**25)
    for schema in ({"type": "number", "default": 1e30}, {"type": "number", "examples": [1e25, 2**60]}):
        assert inexact_number(schema) is None
        compile_json_schema(schema, "response_format")
