"""JSON sent inside a string field (tool-call arguments in the history, a JSON schema as a string)
is held to the body's own rules, and the other bad-input findings of the outside fuzzing pass.

Each case here was a 500, an accepted request or a message leaking Python internals before the
fix; the answer now is a 400 naming the field.
"""

from __future__ import annotations

import json
from typing import Any

import pytest
from fastapi.testclient import TestClient

from api_fakes import MODEL, FakeManager, assert_error, chat, completion
from lightllm.server.http.validation.body import MAX_JSON_DEPTH
from lightllm.server.http.errors import APIError
from lightllm.server.http.validation.json_text import parse_json_text

LONE_SURROGATE = json.dumps({"x": "\ud800"})  # the text {"x": "\ud800"}: valid JSON, not valid Unicode
ARGUMENTS = "messages.1.tool_calls.0.function.arguments"


def _nested(levels: int) -> str:
    """JSON text of ``levels`` nested objects."""
    return '{"a":' * levels + "1" + "}" * levels


def _history(arguments: str) -> list[dict[str, Any]]:
    return [{"role": "user", "content": "hi"},
            {"role": "assistant", "tool_calls": [{"id": "c", "type": "function",
                                                  "function": {"name": "f", "arguments": arguments}}]},
            {"role": "tool", "tool_call_id": "c", "content": "done"}]


# ---------------------------------------------------------------- the shared reader


@pytest.mark.parametrize(
    ("text", "words"),
    [
        (LONE_SURROGATE, "lone UTF-16 surrogate"),
        ('{"\\udc00": 1}', "object key with a lone"),
        ('{"x": NaN}', "not finite"),
        ('{"x": [-Infinity]}', "not finite"),
        ('{"x": 1e999}', "not finite"),
        (_nested(MAX_JSON_DEPTH + 1), f"nested more than {MAX_JSON_DEPTH} levels"),
        (_nested(100_000), f"nested more than {MAX_JSON_DEPTH} levels"),  # too deep for json.loads itself
        ('{"a": 1, "a": 2}', "repeats the key 'a'"),
        ('{"x": ' + "9" * 5000 + "}", "more than 4300 digits"),
        ("{not json", "not valid JSON"),
    ],
    ids=["surrogate", "surrogate-key", "nan", "infinity", "overflow", "depth-33", "depth-100000", "repeated-key",
         "long-integer", "malformed"],
)
def test_the_reader_refuses_what_the_body_refuses(text: str, words: str) -> None:
    with pytest.raises(APIError) as caught:
        parse_json_text(text, "field.x")
    assert caught.value.status_code == 400 and caught.value.param == "field.x"
    assert words in caught.value.message
    assert "recursion" not in caught.value.message and "sys." not in caught.value.message


def test_the_reader_counts_depth_from_the_strings_own_root() -> None:
    assert parse_json_text(_nested(MAX_JSON_DEPTH), "f") is not None
    assert parse_json_text('{"s": "\\ud83d\\ude00"}', "f") == {"s": "\U0001F600"}  # a surrogate pair is fine
    assert parse_json_text('{"a": 1, "a": 2}', "f", unique_keys=False) == {"a": 2}


# ---------------------------------------------------------------- tool-call arguments in the history


@pytest.mark.parametrize(
    ("arguments", "words"),
    [
        (LONE_SURROGATE, "lone UTF-16 surrogate"),  # was a 500 from the tokenizer
        (_nested(1000), f"nested more than {MAX_JSON_DEPTH} levels"),  # was a 500 (RecursionError)
        (_nested(800), f"nested more than {MAX_JSON_DEPTH} levels"),  # was a 400 leaking "maximum recursion"
        ('{"x": NaN}', "not finite"),  # was accepted
        ("{not json", "not valid JSON"),
        ("[1, 2]", "must encode a JSON object, got array"),
    ],
    ids=["surrogate", "depth-1000", "depth-800", "nan", "malformed", "array"],
)
def test_bad_tool_call_arguments_are_a_400_naming_them(client: TestClient, manager: FakeManager, arguments: str,
                                                       words: str) -> None:
    for response in (chat(client, messages=_history(arguments), max_tokens=1),
                     client.post("/tokenize", json={"model": MODEL, "messages": _history(arguments)})):
        error = assert_error(response, 400, ARGUMENTS)
        assert words in error["message"] and "recursion" not in error["message"]
    assert manager.calls == []


def test_good_tool_call_arguments_still_reach_the_template(client: TestClient) -> None:
    assert chat(client, messages=_history('{"city": "Paris", "n": 2}'), max_tokens=1).status_code == 200
    # A repeated key, as a model's own output may hold (and a client sends back), is read as JSON readers do.
    assert chat(client, messages=_history('{"a": 1, "a": 2}'), max_tokens=1).status_code == 200


# ---------------------------------------------------------------- a JSON schema sent as a string


@pytest.mark.parametrize("levels", [MAX_JSON_DEPTH + 1, 40, 800, 1000])
def test_schema_strings_nested_past_the_limit_are_a_400(client: TestClient, levels: int) -> None:
    schema = _nested(levels)
    for response, param in ((completion(client, max_tokens=1, guided_json=schema), "guided_json"),
                            (completion(client, max_tokens=1, structured_outputs={"json": schema}),
                             "structured_outputs.json"),
                            (client.post("/generate", json={"inputs": "a", "parameters": {
                                "max_new_tokens": 1, "guided_json": schema}}), "parameters.guided_json")):
        error = assert_error(response, 400, param)
        assert f"nested more than {MAX_JSON_DEPTH} levels" in error["message"]


@pytest.mark.parametrize("schema", [json.dumps({"type": "string", "pattern": "\ud800"}),
                                    '{"type": "number", "maximum": NaN}'], ids=["surrogate", "nan"])
def test_schema_strings_with_a_lone_surrogate_or_nan_are_a_400(client: TestClient, schema: str) -> None:
    assert_error(completion(client, max_tokens=1, guided_json=schema), 400, "guided_json")
    assert_error(client.post("/generate", json={"inputs": "a", "parameters": {"max_new_tokens": 1,
                                                                            "guided_json": schema}}),
                 400, "parameters.guided_json")


def test_a_schema_string_within_the_rules_is_still_accepted(client: TestClient) -> None:
    schema = json.dumps({"type": "object", "properties": {"a": {"type": "integer"}}})
    assert completion(client, max_tokens=1, guided_json=schema).status_code == 200


# ---------------------------------------------------------------- max_tokens beside max_completion_tokens


@pytest.mark.parametrize("max_tokens", [2**63, 1e30, 2**31])
def test_max_tokens_is_range_checked_beside_max_completion_tokens(client: TestClient, max_tokens: Any) -> None:
    alone = assert_error(chat(client, max_tokens=max_tokens), 400, "max_tokens")
    both = assert_error(chat(client, max_tokens=max_tokens, max_completion_tokens=3), 400, "max_tokens")
    assert both["message"] == alone["message"]
    assert "max_tokens must be at most 2147483647" in both["message"]


def test_a_valid_max_tokens_beside_max_completion_tokens_is_fine(client: TestClient, manager: FakeManager) -> None:
    assert chat(client, max_tokens=2**31 - 1, max_completion_tokens=3).status_code == 200
    assert manager.calls[-1].params.max_new_tokens == 3


# ---------------------------------------------------------------- strict literal booleans, multimodal_params


@pytest.mark.parametrize(
    ("fields", "param"),
    [
        ({"store": 0}, "store"),
        ({"store": 0.0}, "store"),
        ({"spaces_between_special_tokens": 1}, "spaces_between_special_tokens"),
        ({"stream": True, "stream_options": {"include_obfuscation": 0}}, "stream_options.include_obfuscation"),
    ],
)
def test_literal_boolean_fields_refuse_numbers_like_the_bool_fields(client: TestClient, fields: dict[str, Any],
                                                                    param: str) -> None:
    error = assert_error(completion(client, max_tokens=1, **fields), 400, param)
    assert "valid boolean" in error["message"]
    assert_error(completion(client, max_tokens=1, ignore_eos=0), 400, "ignore_eos")  # the rule they now share


def test_literal_boolean_fields_still_take_their_boolean(client: TestClient) -> None:
    assert completion(client, max_tokens=1, store=False, spaces_between_special_tokens=True).status_code == 200


@pytest.mark.parametrize("params", [{"images": 0, "audios": False}, {"images": ""}, {"audios": {}},
                                    {"images": [0]}, {"images": "x.png"}])
def test_multimodal_params_other_than_empty_lists_are_refused(client: TestClient, params: dict[str, Any]) -> None:
    error = assert_error(client.post("/generate", json={"inputs": "a", "multimodal_params": params}), 400,
                         "multimodal_params")
    assert "multimodal" in error["message"]


@pytest.mark.parametrize("params", [None, {}, {"images": [], "audios": []}, {"images": []}])
def test_empty_multimodal_params_are_accepted(client: TestClient, params: Any) -> None:
    assert client.post("/generate", json={"inputs": "a", "multimodal_params": params}).status_code == 200


# ---------------------------------------------------------------- messages in JSON's words


@pytest.mark.parametrize(("raw", "name"), [("null", "null"), ("[1]", "array"), ("3", "number"), ('"s"', "string"),
                                           ("true", "boolean")])
def test_a_body_that_is_not_an_object_is_named_in_json_terms(client: TestClient, raw: str, name: str) -> None:
    response = client.post("/v1/completions", content=raw.encode(), headers={"content-type": "application/json"})
    error = assert_error(response, 400)
    assert error["message"] == f"The request body must be a JSON object, got {name}"
