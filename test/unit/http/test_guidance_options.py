"""A JSON schema's top-level ``x-guidance`` (llguidance's own options) is held to one rule on every route.

llguidance honours the options at a schema's root, and some undid what the server checks:
``{"type": "array", "uniqueItems": true, ..., "x-guidance": {"lenient": true}}`` was served with
``[2,0,0,0]`` (without ``x-guidance``: 400 ``Unimplemented keys uniqueItems``), ``coerce_one_of``
read ``oneOf`` as ``anyOf``, and ``whitespace_pattern`` or an ``item_separator`` of ``";"`` made a
JSON constraint write text that is not JSON, even beside ``disable_any_whitespace: true``.

The app is the real ``create_app`` over ``api_fakes``' scripted manager; grammars are compiled and
matched by the real llguidance.
"""

from __future__ import annotations

from typing import Any, Callable

import pytest
from fastapi.testclient import TestClient

from api_fakes import FakeManager, assert_error, chat, completion

UNIQUE = {"type": "array", "items": {"type": "integer", "minimum": 0, "maximum": 2}, "minItems": 4, "maxItems": 4,
          "uniqueItems": True}
ARRAY = {"type": "array", "items": {"type": "integer"}, "maxItems": 3}


def _tool(schema: dict[str, Any]) -> list[dict[str, Any]]:
    return [{"type": "function", "function": {"name": "f", "parameters": schema}}]


def _native(client: TestClient, schema: dict[str, Any]) -> Any:
    return client.post("/generate", json={"inputs": "hi", "parameters": {"max_new_tokens": 2, "guided_json": schema}})


# Every route that reads a JSON schema, with the field its refusals name.
ROUTES: list[tuple[Callable[[TestClient, dict[str, Any]], Any], str]] = [
    (lambda client, schema: completion(client, structured_outputs={"json": schema}), "structured_outputs.json"),
    (lambda client, schema: chat(client, structured_outputs={"json": schema}), "structured_outputs.json"),
    (lambda client, schema: completion(client, guided_json=schema), "guided_json"),
    (lambda client, schema: chat(client, response_format={"type": "json_schema", "json_schema": {
        "name": "x", "schema": schema}}), "response_format.json_schema.schema"),
    (lambda client, schema: chat(client, tools=_tool({"type": "object", "properties": {"a": schema},
                                                      "x-guidance": schema.get("x-guidance")}),
                                 tool_choice={"type": "function", "function": {"name": "f"}}),
     "tools.0.function.parameters"),
    # Whatever tool_choice is: one rule wherever a schema is read.
    (lambda client, schema: chat(client, tools=_tool({"type": "object", "x-guidance": schema.get("x-guidance")}),
                                 tool_choice="none"), "tools.0.function.parameters"),
    (_native, "parameters.guided_json"),
]


@pytest.mark.parametrize(("send", "param"), ROUTES)
@pytest.mark.parametrize(("options", "option", "message"), [
    # The reviewer's case: served [2,0,0,0] before, uniqueItems dropped.
    ({"lenient": True}, "lenient", "drop the schema keywords it does not implement (uniqueItems, not, contains"),
    ({"coerce_one_of": True}, "coerce_one_of", "read oneOf as anyOf"),
    ({"whitespace_pattern": "x*"}, "whitespace_pattern", "the output need not be JSON; send null or omit it"),
    ({"item_separator": ";"}, "item_separator", '";" is refused: the output would not be JSON'),
    ({"item_separator": ",\u200b"}, "item_separator", "the output would not be JSON"),
    ({"key_separator": "="}, "key_separator", "JSON's separator is \":\""),
    ({"json_allowed_escapes": "n"}, "json_allowed_escapes", "is not accepted here (llguidance's option)"),
    ({"whitespace_flexible": False, "colour": 1}, "colour", "(not one of llguidance's options)"),
    ({"lenient": None}, "lenient", "must be false (true is refused) or left out"),
    ({"whitespace_flexible": "yes"}, "whitespace_flexible", "must be true or false"),
])
def test_options_that_undo_the_checks_are_refused(client: TestClient, send: Any, param: str,
                                                  options: dict[str, Any], option: str, message: str) -> None:
    error = assert_error(send(client, {**UNIQUE, "x-guidance": options}), 400, f"{param}.x-guidance.{option}")
    assert f"x-guidance.{option} " in error["message"] and message in error["message"], error


@pytest.mark.parametrize("send", [completion, chat])
def test_a_non_object_x_guidance_is_refused(client: TestClient, send: Any) -> None:
    # llguidance ignores it without a word.
    error = assert_error(send(client, guided_json={"type": "integer", "x-guidance": "lenient"}), 400,
                         "guided_json.x-guidance")
    assert "x-guidance must be an object" in error["message"], error


def _accepts(grammar: str, text: str) -> bool:
    """Whether llguidance's matcher for ``grammar`` takes ``text`` whole, byte by byte."""
    import llguidance

    from lightllm.server.http.structured.response_format import _byte_tokenizer

    matcher = llguidance.LLMatcher(_byte_tokenizer(), grammar)
    return matcher.consume_tokens(list(text.encode())) and not matcher.is_error() and matcher.is_accepting()


@pytest.mark.parametrize(("options", "takes", "refuses"), [
    (None, ["[1,2]"], ["[1, 2]"]),
    ({"lenient": False, "coerce_one_of": False, "whitespace_pattern": None}, ["[1,2]"], ["[1, 2]"]),
    ({"item_separator": ",", "key_separator": ":"}, ["[1,2]"], ["[1, 2]"]),
    ({"item_separator": ", "}, ["[1, 2]"], ["[1,2]", "[1;2]"]),
    ({"item_separator": "\n,\t"}, ["[1\n,\t2]"], ["[1,2]"]),
    # JSON's own white space between tokens: a bounded schema may then run to max_tokens in it.
    ({"whitespace_flexible": True}, ["[1,2]", "[ 1 ,\n2 ]"], ["[1,\u200b2]"]),
])
def test_options_that_keep_the_output_json_are_applied(client: TestClient, manager: FakeManager,
                                                       options: Any, takes: list[str], refuses: list[str]) -> None:
    response = completion(client, structured_outputs={"json": {**ARRAY, "x-guidance": options}})
    assert response.status_code == 200, response.text
    grammar = manager.calls[-1].params.grammar
    assert all(_accepts(grammar, text) for text in takes)
    assert not any(_accepts(grammar, text) for text in refuses)


@pytest.mark.parametrize(("options", "option", "accepted"), [
    ({"whitespace_flexible": True}, "whitespace_flexible", False),
    ({"item_separator": ", "}, "item_separator", False),
    ({"key_separator": ": "}, "key_separator", False),
    ({"whitespace_flexible": False, "item_separator": ",", "key_separator": ":"}, None, True),
])
def test_disable_any_whitespace_allows_only_the_compact_layout(client: TestClient, options: dict[str, Any],
                                                               option: Any, accepted: bool) -> None:
    for schema in ({**ARRAY, "x-guidance": options}, f'{{"type": "object", "x-guidance": {_json(options)}}}'):
        response = chat(client, structured_outputs={"json": schema, "disable_any_whitespace": True})
        if accepted:
            assert response.status_code == 200, response.text
            continue
        error = assert_error(response, 400, f"structured_outputs.json.x-guidance.{option}")
        assert "cannot be applied: structured_outputs.disable_any_whitespace true asks for JSON without white " \
               "space" in error["message"], error


def _json(value: Any) -> str:
    import json

    return json.dumps(value)


def test_a_tools_layout_options_are_refused_under_required_where_they_are_not_read(client: TestClient) -> None:
    # Under "required" the tool's schema sits in the wrapper's $defs, where llguidance reads no x-guidance.
    tools = _tool({"type": "object", "properties": {"a": ARRAY}, "x-guidance": {"whitespace_flexible": True}})
    error = assert_error(chat(client, tools=tools, tool_choice="required"), 400,
                         "tools.0.function.parameters.x-guidance.whitespace_flexible")
    assert "llguidance reads x-guidance only at that schema's root" in error["message"], error
    named = {"type": "function", "function": {"name": "f"}}
    assert chat(client, tools=tools, tool_choice=named).status_code == 200
    compact = _tool({"type": "object", "x-guidance": {"whitespace_flexible": False, "lenient": False}})
    assert chat(client, tools=compact, tool_choice="required").status_code == 200


@pytest.mark.parametrize("where", ["properties", "$defs"])
def test_a_nested_x_guidance_is_not_read_by_llguidance(client: TestClient, where: str) -> None:
    """The rule reads the root only: llguidance ignores x-guidance anywhere else (checked here)."""
    nested = {**UNIQUE, "x-guidance": {"lenient": True}}
    schema = ({"type": "object", "properties": {"a": nested}} if where == "properties"
              else {"$ref": "#/$defs/A", "$defs": {"A": nested}})
    error = assert_error(completion(client, guided_json=schema), 400, "guided_json")
    assert 'Unimplemented keys: ["uniqueItems"]' in error["message"], error
