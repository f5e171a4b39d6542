"""An integer in a JSON schema beyond what the grammar compiler is given is refused naming it and where it is.

The compiler (llguidance) reads 64-bit integers only; beyond them it failed with "Value is not JSON
serializable: <n>", which named neither the place nor the limit, for a schema that is valid JSON Schema;
an enum or const integer near -2^63 crashed the process (a segmentation fault in llguidance 1.9).
"""

from __future__ import annotations

import pytest

from lightllm.server.http.errors import APIError
from lightllm.server.http.response_format import compile_json_schema, integer_beyond_compiler


@pytest.mark.parametrize(("schema", "path", "number"), [
    ({"type": "integer", "minimum": 10**20, "maximum": 10**20 + 5}, "minimum", 10**20),
    ({"properties": {"x": {"enum": [1, -(2**63) - 1]}}}, "properties.x.enum.1", -(2**63) - 1),
    ({"const": -(2**63) + 1}, "const", -(2**63) + 1),
    ({"enum": [-(2**62) - 1]}, "enum.0", -(2**62) - 1),
    ({"anyOf": [{"const": 2**64}]}, "anyOf.0.const", 2**64),
])
def test_an_integer_beyond_64_bits_is_refused_with_its_place(schema, path, number) -> None:
    assert integer_beyond_compiler(schema) == (path, number)
    with pytest.raises(APIError) as refused:
        compile_json_schema(schema, "response_format")
    assert refused.value.param == "response_format"
    assert f"the integer {number} at '{path}' is beyond what the grammar compiler is given" in refused.value.message


def test_the_compilers_own_range_and_booleans_pass() -> None:
    for schema in ({"enum": [-(2**62), 2**64 - 1]}, {"const": True}):
        assert integer_beyond_compiler(schema) is None
        compile_json_schema(schema, "response_format")


@pytest.mark.parametrize("grammar", ['start: %json {"enum": [-9223372036854775807]}',
                                     'start: "a" | %json {"properties": {"x": {"const": -9223372036854775800}}}'])
def test_a_lark_grammar_embedding_such_an_integer_is_refused_before_the_compiler_sees_it(grammar) -> None:
    # One /v1/completions request with this guided_grammar ended the whole server (no answer, the
    # health port gone, shared memory left behind).
    from lightllm.server.http.structured_params import structured_grammar

    with pytest.raises(APIError) as refused:
        structured_grammar(None, {"guided_grammar": grammar})
    assert "beyond what the grammar compiler is given (-2^62 to 2^64-1)" in refused.value.message
