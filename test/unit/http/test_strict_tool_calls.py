"""A function declared ``"strict": true`` gets, under ``tool_choice: "auto"``, only calls whose arguments are
valid under its schema; any other block stays content, as the model wrote it, in both a response and a stream."""

from __future__ import annotations

import copy
from typing import Any

import pytest

from api_fakes import assert_error, chat, sse_events
from scripted_manager import make_client

ADD_TOOL = {"type": "function", "function": {
    "name": "add", "strict": True,
    "parameters": {"type": "object", "properties": {"a": {"type": "integer"}, "b": {"type": "integer"}},
                   "required": ["a", "b"]}}}


def _call_text(arguments: str) -> list[str]:
    return ["Adding.", "\n<tool_call>\n", '{"name": "add", "arguments": ', arguments, "}\n</tool_call>"]


def _tool(strict: Any) -> dict[str, Any]:
    tool = copy.deepcopy(ADD_TOOL)
    tool["function"]["strict"] = strict
    return tool


def _answers(arguments: str, tool: dict[str, Any]) -> tuple[dict[str, Any], list[dict[str, Any]]]:
    client, _ = make_client(_call_text(arguments))
    response = chat(client, tools=[tool])
    assert response.status_code == 200, response.text
    events = sse_events(chat(client, tools=[tool], stream=True))
    return response.json()["choices"][0], [event["choices"][0] for event in events[:-1] if event["choices"]]


def _streamed(deltas: list[dict[str, Any]]) -> tuple[str, list[dict[str, Any]], str]:
    content = "".join(choice["delta"].get("content") or "" for choice in deltas)
    calls = [entry["function"] for choice in deltas for entry in choice["delta"].get("tool_calls", [])]
    return content, calls, deltas[-1]["finish_reason"]


@pytest.mark.parametrize("arguments", ['{"a": 1, "b": 2}', '{"b": 2, "a": 1}', '{ "a" : 1 ,"b":2.0 }'])
def test_valid_arguments_are_a_call_in_any_property_order(arguments: str) -> None:
    choice, deltas = _answers(arguments, ADD_TOOL)
    assert choice["finish_reason"] == "tool_calls"
    assert [call["function"] for call in choice["message"]["tool_calls"]] == [{"name": "add", "arguments": arguments}]
    assert _streamed(deltas) == ("Adding.", [{"name": "add", "arguments": arguments}], "tool_calls")


@pytest.mark.parametrize("arguments", [
    '{"a": "x", "b": 2}',      # a string for an integer
    '{"a": 1}',                # a required property left out
    '{"a": 1, "b": 2, "c": 3}',  # a key the schema does not list (objects are closed, as OpenAI's strict mode)
])
def test_arguments_breaking_a_strict_schema_stay_content(arguments: str) -> None:
    text = "".join(_call_text(arguments))
    choice, deltas = _answers(arguments, ADD_TOOL)
    assert choice["finish_reason"] == "stop"
    assert "tool_calls" not in choice["message"] or not choice["message"]["tool_calls"]
    assert choice["message"]["content"] == text
    assert _streamed(deltas) == (text, [], "stop")


@pytest.mark.parametrize("strict", [False, None])
def test_without_strict_the_arguments_are_not_checked(strict: Any) -> None:
    choice, _ = _answers('{"a": "x", "b": 2}', _tool(strict))
    assert choice["finish_reason"] == "tool_calls"
    assert choice["message"]["tool_calls"][0]["function"]["arguments"] == '{"a": "x", "b": 2}'


def test_a_strict_schema_that_is_not_json_schema_is_refused_naming_it() -> None:
    tool = _tool(True)
    tool["function"]["parameters"]["properties"]["a"] = {"type": "integr"}
    client, _ = make_client(_call_text('{"a": 1, "b": 2}'))
    assert_error(chat(client, tools=[tool]), 400, "tools.0.function.parameters")


@pytest.mark.parametrize(("parameters", "param"), [
    ({"type": "object", "properties": {"a": {"$ref": "#/$defs/missing"}}, "required": ["a"]},
     "tools.0.function.parameters"),
    ({"type": "object", "properties": {"a": {"$ref": "https://example.com/a.json"}}, "required": ["a"]},
     "tools.0.function.parameters"),
])
def test_a_strict_schema_the_compiler_refuses_is_a_400_not_a_500_when_a_call_is_read(parameters: dict,
                                                                                     param: str) -> None:
    tool = _tool(True)
    tool["function"]["parameters"] = parameters
    client, _ = make_client(_call_text('{"a": 1}'))
    assert_error(chat(client, tools=[tool]), 400, param)


def test_an_ecma_pattern_pythons_re_cannot_read_leaves_the_call_unchecked() -> None:
    # \p{L} and named groups are ECMA-262 (the grammar compiler takes them); Python's re does not.
    tool = _tool(True)
    tool["function"]["parameters"] = {"type": "object", "properties": {
        "a": {"type": "string", "pattern": "^\\p{L}+$"}, "b": {"type": "string", "pattern": "^(?<y>\\d{4})$"}},
        "required": ["a", "b"]}
    choice, deltas = _answers('{"a": "word", "b": "2024"}', tool)
    assert choice["finish_reason"] == "tool_calls"
    assert _streamed(deltas)[2] == "tool_calls"


@pytest.mark.parametrize("property_schema", [
    {"type": "string", "enum": [f"city{index}" for index in range(1500)]},  # a grammar over 16 KiB
    {"type": "number", "exclusiveMinimum": 0, "maximum": 0.5},  # a range the compiler would not keep
    {"type": "integer", "enum": [1, 9007199254740993]},  # beyond what the compiler keeps exact
])
def test_limits_of_the_grammar_compiler_do_not_bind_a_strict_check(property_schema: dict) -> None:
    # Under auto nothing is sampled from the schema's grammar: the arguments are validated as JSON.
    tool = _tool(True)
    tool["function"]["parameters"] = {"type": "object", "properties": {"a": property_schema}, "required": ["a"]}
    good = {"string": '"city7"', "number": "0.25", "integer": "9007199254740993"}[property_schema["type"]]
    choice, _ = _answers('{"a": %s}' % good, tool)
    assert choice["finish_reason"] == "tool_calls"


def _pattern_tool(pattern: str, **extra: Any) -> dict[str, Any]:
    tool = _tool(True)
    tool["function"]["parameters"] = {"type": "object", "properties": {"a": {"type": "string", "pattern": pattern},
                                                                       **extra}, "required": ["a", *extra]}
    return tool


def test_a_catastrophic_pattern_for_pythons_re_is_decided() -> None:
    # ^(a+)+$ on 40 a's and a '!' takes Python's re about 2^40 steps: the HTTP process stalled for
    # every client (27 characters: 7.5 s). The regex module decides it (a search that would still
    # run past 50 ms leaves the keyword unchecked): no match, so the block stays content.
    choice, _ = _answers('{"a": "%s!"}' % ("a" * 40), _pattern_tool("^(a+)+$"))
    assert choice["finish_reason"] == "stop"


def test_an_ecma_pattern_is_checked_and_does_not_turn_off_the_other_keywords() -> None:
    tool = _pattern_tool("^\\p{L}+$", n={"type": "integer", "minimum": 0})
    assert _answers('{"a": "word", "n": 3}', tool)[0]["finish_reason"] == "tool_calls"
    assert _answers('{"a": "123", "n": 3}', tool)[0]["finish_reason"] == "stop"  # the pattern holds
    assert _answers('{"a": "word", "n": -4}', tool)[0]["finish_reason"] == "stop"  # and so does minimum


def test_digits_are_ascii_as_in_ecma_patterns() -> None:
    assert _answers('{"a": "\\u0663\\u0664\\u0665"}', _pattern_tool("^\\d{3}$"))[0]["finish_reason"] == "stop"
    assert _answers('{"a": "345"}', _pattern_tool("^\\d{3}$"))[0]["finish_reason"] == "tool_calls"
