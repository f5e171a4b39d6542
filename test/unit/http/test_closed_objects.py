"""An object schema that lists its properties takes no others (vLLM's xgrammar strict mode, OpenAI's
strict mode), unless it says so; the schema's data and allOf branches are left alone."""

from __future__ import annotations

import llguidance
import pytest

from lightllm.server.http.structured.closed_objects import closed_objects
from lightllm.server.http.errors import APIError
from lightllm.server.http.structured.response_format import (_byte_tokenizer, compile_json_schema,
                                                             response_format_grammar)

# As pydantic writes a model's schema: no additionalProperties.
PERSON = {"properties": {"name": {"title": "Name", "type": "string"}, "age": {"type": "integer"}},
          "required": ["name", "age"], "title": "Person", "type": "object"}


def _accepts(grammar: str, text: str) -> bool:
    matcher = llguidance.LLMatcher(_byte_tokenizer(), grammar, log_level=0)
    return bool(matcher.consume_tokens(list(text.encode()))) and not matcher.is_error() and matcher.is_accepting()


def test_a_pydantic_schema_takes_no_undeclared_key():
    grammar = compile_json_schema(PERSON, "tools")
    assert _accepts(grammar, '{"name":"a","age":3}')
    assert not _accepts(grammar, '{"name":"a","age":3,"extra":1}')


def test_nested_objects_and_definitions_are_closed_too():
    schema = {"type": "object", "properties": {"who": {"$ref": "#/$defs/Person"}}, "required": ["who"],
              "$defs": {"Person": PERSON}}
    grammar = compile_json_schema(schema, "tools")
    assert _accepts(grammar, '{"who":{"name":"a","age":3}}')
    assert not _accepts(grammar, '{"who":{"name":"a","age":3,"x":1}}')
    assert not _accepts(grammar, '{"who":{"name":"a","age":3},"x":1}')


@pytest.mark.parametrize("opening", [{"additionalProperties": True}, {"additionalProperties": {"type": "integer"}},
                                     {"patternProperties": {"^x": {"type": "integer"}}}])
def test_a_schema_that_says_what_other_keys_may_do_keeps_its_rule(opening):
    grammar = compile_json_schema({**PERSON, **opening}, "tools")
    assert _accepts(grammar, '{"name":"a","age":3,"x":1}')


def test_json_object_mode_and_allof_branches_stay_open():
    assert _accepts(response_format_grammar({"type": "json_object"}), '{"z":1}')
    both = {"type": "object", "allOf": [{"properties": {"a": {"type": "integer"}}},
                                        {"properties": {"b": {"type": "integer"}}}]}
    assert _accepts(compile_json_schema(both, "tools"), '{"a":1,"b":2}')


def test_data_keywords_are_not_rewritten_and_the_input_is_not_changed():
    schema = {"type": "object", "properties": {"p": {"const": {"properties": {}}, "default": {"properties": {}}}}}
    closed = closed_objects(schema)
    assert closed["additionalProperties"] is False
    assert closed["properties"]["p"] == {"const": {"properties": {}}, "default": {"properties": {}}}
    assert "additionalProperties" not in schema


@pytest.mark.parametrize("schema", [
    {"type": "object", "additionalProperties": {"type": "integer"}, "minProperties": 2},
    {"type": "object", "minProperties": 2},
    {"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"], "additionalProperties": True,
     "minProperties": 2},
    {"type": "object", "properties": {"inner": {"type": "object", "patternProperties": {"^x": {}},
                                                "minProperties": 2}}},
])
def test_a_min_properties_the_grammar_cannot_keep_is_refused(schema):
    """Keys an object does not name may repeat in the output ({"":0,"":4} met minProperties 2 and parses
    to one property), so a minimum beyond the required named keys cannot be promised."""
    with pytest.raises(APIError) as refused:
        compile_json_schema(schema, "response_format.json_schema.schema")
    assert refused.value.param == "response_format.json_schema.schema"
    assert "minProperties" in str(refused.value) and "may repeat" in str(refused.value)


def test_a_min_properties_met_by_required_named_keys_or_a_closed_object_is_kept():
    for schema in ({"type": "object", "properties": {"a": {"type": "integer"}, "b": {"type": "integer"}},
                    "required": ["a", "b"], "additionalProperties": True, "minProperties": 2},
                   {"type": "object", "properties": {"a": {"type": "integer"}, "b": {"type": "integer"}},
                    "minProperties": 1},
                   # A non-empty dictionary (pydantic's Dict[...] = Field(min_length=1)): one key always holds.
                   {"type": "object", "additionalProperties": {"type": "integer"}, "minProperties": 1}):
        grammar = compile_json_schema(schema, "x")
        assert _accepts(grammar, '{"a":1,"b":2}') and not _accepts(grammar, '{}')


def test_a_schema_reached_through_an_openapi_reference_is_closed_as_a_definition_is() -> None:
    schema = {"type": "object", "properties": {"p": {"$ref": "#/components/schemas/P"}},
              "components": {"schemas": {"P": {"type": "object", "properties": {"q": {"type": "integer"}}}}}}
    assert closed_objects(schema)["components"]["schemas"]["P"]["additionalProperties"] is False
