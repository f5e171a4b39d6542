"""A number range the grammar compiler would let a value out of is refused, naming it and where it is.

llguidance 1.9 compiles ``exclusiveMinimum: 0, maximum: 0.5`` to a grammar that takes ``0``: sampled
answers broke the schema the server promised to keep.  The tests below check both halves of the
claim in :mod:`lightllm.server.http.structured.number_bounds` against the compiler itself: what is refused is
let out by the compiler, and what passes is kept by it (so a fixed compiler fails them, and the
refusal can go).
"""

from __future__ import annotations

import itertools
import json
from fractions import Fraction

import pytest

from lightllm.server.http.errors import APIError
from lightllm.server.http.structured.number_bounds import unkept_number_range
from lightllm.server.http.structured.response_format import _byte_tokenizer, compile_json_schema

_CANDIDATES = [str(value) for value in range(-3, 4)] + ["-0", "-0.5", "0.5", "1.5", "-1.5", "2.25", "-2.25"]


def _compiler_takes(schema: dict, text: str) -> bool:
    import llguidance

    grammar = llguidance.LLMatcher.grammar_from_json_schema(schema, defaults={"whitespace_flexible": False})
    matcher = llguidance.LLMatcher(_byte_tokenizer(), grammar, log_level=0)
    return matcher.consume_tokens(list(text.encode())) and matcher.is_accepting()


def _within(schema: dict, text: str) -> bool:
    value = Fraction(text)
    checks = {"minimum": value.__ge__, "exclusiveMinimum": value.__gt__, "maximum": value.__le__,
              "exclusiveMaximum": value.__lt__}
    return all(check(Fraction(schema[key])) for key, check in checks.items() if key in schema)


def _ranges() -> list[dict]:
    bounds = [-2, -1.5, -1, -0.5, 0, 0.5, 1, 1.5, 2]
    ranges = []
    for low, high in itertools.combinations(bounds, 2):
        for low_key, high_key in itertools.product(("minimum", "exclusiveMinimum"), ("maximum", "exclusiveMaximum")):
            ranges.append({"type": "number", low_key: low, high_key: high})
    return ranges


def test_a_range_is_refused_exactly_when_the_compiler_lets_a_number_outside_it_through() -> None:
    let_out, refused = set(), set()
    for schema in _ranges():
        if any(_compiler_takes(schema, text) and not _within(schema, text) for text in _CANDIDATES):
            let_out.add(json.dumps(schema))
        if unkept_number_range(schema) is not None:
            refused.add(json.dumps(schema))
    assert let_out == refused
    assert json.dumps({"type": "number", "exclusiveMinimum": 0, "maximum": 0.5}) in refused


@pytest.mark.parametrize(("schema", "message"), [
    ({"type": "number", "exclusiveMinimum": 0, "maximum": 0.5},
     "exclusiveMinimum 0 with maximum 0.5 cannot be kept"),
    ({"properties": {"p": {"type": ["number", "null"], "minimum": -0.5, "exclusiveMaximum": 0}}},
     "exclusiveMaximum 0 with minimum -0.5 at 'properties.p' cannot be kept"),
    ({"anyOf": [{"type": "string"}, {"exclusiveMinimum": 2, "exclusiveMaximum": 2.5}]},
     "exclusiveMinimum 2 with exclusiveMaximum 2.5 at 'anyOf.1' cannot be kept"),
    # Bounds met together: an allOf's branches and a local reference's target.
    ({"allOf": [{"exclusiveMinimum": 0}, {"allOf": [{"maximum": 0.75}]}]},
     "exclusiveMinimum 0 with maximum 0.75 cannot be kept"),
    ({"$defs": {"small": {"maximum": 0.5}}, "properties": {"p": {"$ref": "#/$defs/small", "exclusiveMinimum": 0}}},
     "exclusiveMinimum 0 with maximum 0.5 at 'properties.p' cannot be kept"),
])
def test_an_unkept_range_is_a_400_naming_it_and_its_place(schema: dict, message: str) -> None:
    with pytest.raises(APIError) as refused:
        compile_json_schema(schema, "response_format")
    assert refused.value.param == "response_format"
    assert message in refused.value.message
    assert "give an inclusive" in refused.value.message


@pytest.mark.parametrize("schema", [
    {"type": "number", "exclusiveMinimum": 0, "maximum": 1},
    {"type": "number", "exclusiveMinimum": 0},
    {"type": "integer", "exclusiveMinimum": 0, "maximum": 1.5},
    {"type": "number", "minimum": 0.000001, "maximum": 0.5},
    {"type": "number", "exclusiveMinimum": -1, "maximum": -0.5},
    {"$defs": {"loop": {"$ref": "#/$defs/loop"}}, "properties": {"p": {"$ref": "#/$defs/loop"}}},
])
def test_ranges_the_compiler_keeps_compile(schema: dict) -> None:
    assert unkept_number_range(schema) is None
    compile_json_schema(schema, "response_format")


def test_a_range_reached_through_an_openapi_reference_is_refused() -> None:
    # OpenAPI keeps its schemas under #/components/schemas, where no keyword holds them; the
    # compiler follows the $ref, so the check must too (llguidance took {"p": {"q": 0}} here).
    schema = {"type": "object", "properties": {"p": {"$ref": "#/components/schemas/P"}}, "required": ["p"],
              "components": {"schemas": {"P": {"type": "object", "required": ["q"], "properties": {
                  "q": {"type": "number", "exclusiveMinimum": 0, "maximum": 0.5}}}}}}
    with pytest.raises(APIError) as refused:
        compile_json_schema(schema, "response_format")
    assert "at 'components.schemas.P.properties.q' cannot be kept" in refused.value.message
