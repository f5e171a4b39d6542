"""Grammars are compiled off the event loop, and a ``multipleOf`` that would take the compiler seconds is refused.

A schema's ``{"type": "integer", "multipleOf": 999983}`` took the grammar compiler 5 to 25 s; compiled
on the event loop it held every other client of the HTTP process for that long (``/v1/models`` 18 s,
an unrelated stream stalled 19 s).
"""

from __future__ import annotations

import asyncio
from typing import Any

import pytest
from fastapi.testclient import TestClient

from api_fakes import assert_error, chat, completion
from lightllm.server.http.structured.response_format import compile_json_schema
from lightllm.server.http.structured.schema_cost import costly_multiple_of


@pytest.mark.parametrize(("schema", "message"), [
    ({"type": "integer", "multipleOf": 999983}, "multipleOf 999983 would take the grammar compiler too long"),
    ({"properties": {"n": {"type": "integer", "multipleOf": 2**24}}},
     "multipleOf 16777216 at 'properties.n' would take"),
    ({"type": "number", "multipleOf": 1234.567}, "multipleOf 1234.567 would take"),
])
def test_a_costly_multiple_of_is_refused_naming_it(schema: dict, message: str) -> None:
    assert costly_multiple_of(schema) is not None
    with pytest.raises(Exception) as refused:
        compile_json_schema(schema, "response_format")
    assert message in refused.value.message


@pytest.mark.parametrize("divisor", [3000000, 99983, 0.01, 0.25, 65536, 1e-6])
def test_cheap_divisors_compile(divisor: Any) -> None:
    schema = {"type": "integer" if isinstance(divisor, int) else "number", "multipleOf": divisor}
    assert costly_multiple_of(schema) is None
    compile_json_schema(schema, "response_format")


def _on_event_loop() -> bool:
    try:
        asyncio.get_running_loop()
    except RuntimeError:
        return False
    return True


@pytest.fixture()
def compile_threads(monkeypatch: pytest.MonkeyPatch) -> list[bool]:
    """Records, for each grammar validated, whether it ran on a thread running an event loop."""
    import llguidance

    seen: list[bool] = []
    validate = llguidance.LLMatcher.validate_grammar

    def recording(*args: Any, **kwargs: Any) -> Any:
        seen.append(_on_event_loop())
        return validate(*args, **kwargs)

    monkeypatch.setattr(llguidance.LLMatcher, "validate_grammar", staticmethod(recording))
    return seen


SCHEMA_FORMAT = {"type": "json_schema", "json_schema": {"name": "n", "schema": {"type": "integer"}}}
TOOL = {"type": "function", "function": {"name": "f", "parameters": {"type": "object", "properties": {}}}}


def test_every_endpoint_compiles_grammars_off_the_event_loop(client: TestClient, compile_threads: list[bool]) -> None:
    assert completion(client, response_format=SCHEMA_FORMAT).status_code == 200
    assert chat(client, response_format=SCHEMA_FORMAT).status_code == 200
    assert chat(client, tools=[TOOL], tool_choice="required").status_code == 200
    native = client.post("/generate", json={"inputs": "hi", "parameters": {"max_new_tokens": 2,
                                                                         "regular_constraint": "[a-z]+"}})
    assert native.status_code == 200, native.text
    assert len(compile_threads) == 4 and not any(compile_threads)


def test_a_refusal_from_a_worker_thread_is_still_a_400(client: TestClient) -> None:
    bad = {"type": "json_schema", "json_schema": {"name": "n", "schema": {"type": "integer", "multipleOf": 999983}}}
    assert_error(completion(client, response_format=bad), 400, "response_format.json_schema.schema")


@pytest.mark.parametrize("grammar", ['start: <[300]> "a"\n', "start: <|im_end|>\n", "start: <[0-4095]>*\n"])
def test_token_references_are_left_to_the_vocabulary_that_has_them(grammar: str) -> None:
    # The admission check's byte vocabulary has 257 tokens and no special ones: these were refused
    # as admitting no output ("Token range end too large: 300") on a 4096-token model.
    from lightllm.server.http.structured.structured_params import structured_grammar

    assert structured_grammar(None, {"guided_grammar": grammar})


def test_an_empty_regular_expression_is_refused_in_words() -> None:
    from lightllm.server.http.structured.structured_params import structured_grammar

    with pytest.raises(Exception) as refused:
        structured_grammar(None, {"guided_regex": "[^\\s\\S]"})
    assert refused.value.message.endswith("admits no output at all (no text matches it)")


@pytest.mark.parametrize(("schema", "message"), [
    # llguidance used the absolute value, and the cost bound did not look at it.
    ({"type": "integer", "multipleOf": -999983}, "multipleOf -999983 must be greater than 0"),
    ({"type": "number", "multipleOf": 0}, "multipleOf 0 must be greater than 0"),
    # Each under the bound, together 52 s of compiling.
    ({"properties": {f"p{index}": {"type": "integer", "multipleOf": 99983 - index} for index in range(20)}},
     "the significant digits of the schema's multipleOf values add up to more than 100000"),
    # Reached only through a $ref to a place no keyword holds.
    ({"foo": {"type": "integer", "multipleOf": 999983}, "$ref": "#/foo"}, "multipleOf 999983 at 'foo' would take"),
])
def test_divisors_the_bound_missed_are_refused(schema: dict, message: str) -> None:
    with pytest.raises(Exception) as refused:
        compile_json_schema(schema, "response_format")
    assert message in refused.value.message
