"""The bounds /openapi.json publishes are the ones the server enforces, at the edge and past it.

An outside walk of the document found values every schema let through and the server refused with a
400 naming the field: /generate's ``parameters`` published almost none of SamplingParams' ranges,
chat's ``max_tokens`` said minimum 0 (only completions' echo takes 0), ``suffix`` said any string
(only null is taken), and the OpenAI lists, message fields, tool calls and ``response_format`` were
looser than their checks.  Each case here sends the value at the edge (both the document and the
server accept it) and the value just past it (both refuse it, the server naming the field).
"""

from __future__ import annotations

import copy
from typing import Any

import pytest
from fastapi.testclient import TestClient

from api_fakes import FakeManager, assert_error
from lightllm.server.http.app import create_app
from lightllm.server.http.server_options import HttpServerOptions

jsonschema = pytest.importorskip("jsonschema")

INT32_MAX, INT64_MAX = 2**31 - 1, 2**63 - 1
_MODELS = {"/generate": "NativeGenerateRequest", "/v1/completions": "CompletionRequest",
           "/v1/chat/completions": "ChatCompletionRequest", "/tokenize": "TokenizeChatRequest"}
_GENERATE = {"inputs": "x", "parameters": {"max_new_tokens": 2}}
_COMPLETION = {"prompt": "x", "max_tokens": 2}
_CHAT = {"messages": [{"role": "user", "content": "x"}], "max_tokens": 2}
_CALL = {"id": "c1", "type": "function", "function": {"name": "clock", "arguments": "{}"}}


@pytest.fixture(scope="module")
def client() -> TestClient:
    return TestClient(create_app(FakeManager(), HttpServerOptions()), raise_server_exceptions=False)


@pytest.fixture(scope="module")
def document(client: TestClient) -> dict[str, Any]:
    return client.get("/openapi.json").json()


def _native(**parameters: Any) -> dict[str, Any]:
    body = copy.deepcopy(_GENERATE)
    body["parameters"].update(parameters)
    return body


def _with(base: dict[str, Any], **fields: Any) -> dict[str, Any]:
    return {**copy.deepcopy(base), **fields}


def _message(**fields: Any) -> dict[str, Any]:
    """A chat whose last message is an assistant turn with ``fields``, after the user's."""
    return _with(_CHAT, messages=[{"role": "user", "content": "x"}, {"role": "assistant", "content": "y", **fields},
                                  {"role": "user", "content": "z"}])


def _tool_call_chat(call: Any) -> dict[str, Any]:
    return _with(_CHAT, messages=[{"role": "user", "content": "x"},
                                  {"role": "assistant", "content": None, "tool_calls": [call]},
                                  {"role": "tool", "tool_call_id": "c1", "content": "12:00"}])


# (path, the param a refusal names, the body at the edge, the body just past it)
_EDGES: list[tuple[str, str, dict[str, Any], dict[str, Any]]] = [
    # /generate: SamplingParams' ranges.
    ("/generate", "parameters.temperature", _native(temperature=0), _native(temperature=-0.01)),
    ("/generate", "parameters.top_p", _native(top_p=1), _native(top_p=1.01)),
    ("/generate", "parameters.top_p", _native(top_p=1e-30), _native(top_p=0)),
    ("/generate", "parameters.min_p", _native(min_p=0), _native(min_p=-0.01)),
    ("/generate", "parameters.min_p", _native(min_p=1), _native(min_p=1.01)),
    ("/generate", "parameters.repetition_penalty", _native(repetition_penalty=1e-30), _native(repetition_penalty=0)),
    ("/generate", "parameters.presence_penalty", _native(presence_penalty=-2), _native(presence_penalty=-2.01)),
    ("/generate", "parameters.presence_penalty", _native(presence_penalty=2), _native(presence_penalty=2.01)),
    ("/generate", "parameters.frequency_penalty", _native(frequency_penalty=-2), _native(frequency_penalty=-2.01)),
    ("/generate", "parameters.frequency_penalty", _native(frequency_penalty=2), _native(frequency_penalty=2.01)),
    ("/generate", "parameters.top_k", _native(top_k=-1), _native(top_k=-2)),
    ("/generate", "parameters.seed", _native(seed=0), _native(seed=-1)),
    ("/generate", "parameters.seed", _native(seed=INT64_MAX), _native(seed=INT64_MAX + 1)),
    ("/generate", "parameters.max_new_tokens", _native(max_new_tokens=1), _native(max_new_tokens=0)),
    ("/generate", "parameters.min_new_tokens", _native(min_new_tokens=0), _native(min_new_tokens=-1)),
    ("/generate", "parameters.logprobs", _native(logprobs=0, return_details=True),
     _native(logprobs=-1, return_details=True)),
    ("/generate", "parameters.logprobs", _native(logprobs=20, return_details=True),
     _native(logprobs=21, return_details=True)),
    ("/generate", "parameters.stop_token_ids", _native(stop_token_ids=[0]), _native(stop_token_ids=[-1])),
    ("/generate", "parameters.stop_token_ids", _native(stop_token_ids=list(range(16))),
     _native(stop_token_ids=list(range(17)))),
    ("/generate", "parameters.stop_sequences", _native(stop_sequences=[f"s{i}" for i in range(16)]),
     _native(stop_sequences=[f"s{i}" for i in range(17)])),
    ("/generate", "parameters.guided_grammar", _native(guided_grammar='start: "a"'), _native(guided_grammar="")),
    ("/generate", "parameters.exponential_decay_length_penalty",
     _native(exponential_decay_length_penalty=[INT32_MAX, 1.5]),
     _native(exponential_decay_length_penalty=[INT32_MAX + 1, 1.5])),
    # max_tokens: 0 is completions' echo alone.
    ("/v1/chat/completions", "max_tokens", _with(_CHAT, max_tokens=1), _with(_CHAT, max_tokens=0)),
    ("/v1/completions", "max_tokens", _with(_COMPLETION, max_tokens=0, echo=True), _with(_COMPLETION, max_tokens=-1)),
    ("/v1/completions", "suffix", _with(_COMPLETION, suffix=None), _with(_COMPLETION, suffix="")),
    # The OpenAI lists.
    ("/v1/completions", "stop_token_ids", _with(_COMPLETION, stop_token_ids=[0]),
     _with(_COMPLETION, stop_token_ids=[-1])),
    ("/v1/chat/completions", "stop_token_ids", _with(_CHAT, stop_token_ids=list(range(16))),
     _with(_CHAT, stop_token_ids=list(range(17)))),
    ("/v1/completions", "stop", _with(_COMPLETION, stop=[f"s{i}" for i in range(16)]),
     _with(_COMPLETION, stop=[f"s{i}" for i in range(17)])),
    ("/v1/completions", "guided_choice", _with(_COMPLETION, guided_choice=[f"c{i}" for i in range(256)]),
     _with(_COMPLETION, guided_choice=[f"c{i}" for i in range(257)])),
    ("/v1/completions", "guided_choice", _with(_COMPLETION, guided_choice=["a"]),
     _with(_COMPLETION, guided_choice=["a", ""])),
    ("/v1/completions", "structured_outputs.choice", _with(_COMPLETION, structured_outputs={"choice": ["a"]}),
     _with(_COMPLETION, structured_outputs={"choice": [""]})),
    # Chat message fields.
    ("/v1/chat/completions", "messages.0.content", _with(_CHAT, messages=[{"role": "user", "content": [
        {"type": "text", "text": "x"}]}]), _with(_CHAT, messages=[{"role": "user", "content": []}])),
    ("/v1/chat/completions", "messages.1.annotations", _message(annotations=[]),
     _message(annotations=[{"type": "url_citation"}])),
    ("/v1/chat/completions", "messages.1.audio", _message(audio=None), _message(audio={"id": "a1"})),
    ("/v1/chat/completions", "messages.1.function_call", _message(function_call=None),
     _message(function_call={"name": "clock", "arguments": "{}"})),
    ("/v1/chat/completions", "messages.1.tool_calls", _tool_call_chat({**_CALL, "index": 0}),
     _tool_call_chat({**_CALL, "type": "web"})),
    ("/v1/chat/completions", "messages.1.tool_calls", _tool_call_chat(_CALL),
     _tool_call_chat({key: value for key, value in _CALL.items() if key != "id"})),
    ("/v1/chat/completions", "messages.1.tool_calls", _tool_call_chat(_CALL), _tool_call_chat({**_CALL, "x": 1})),
    ("/v1/chat/completions", "messages.1.tool_calls", _tool_call_chat(_CALL),
     _tool_call_chat({**_CALL, "function": {"name": "clock", "arguments": "{}", "x": 1}})),
    ("/v1/chat/completions", "messages.1.tool_calls", _tool_call_chat(_CALL),
     _tool_call_chat({**_CALL, "function": {"name": "clock"}})),
    # response_format: one of the three shapes, and no other key.
    ("/v1/chat/completions", "response_format", _with(_CHAT, response_format={"type": "text"}),
     _with(_CHAT, response_format={"type": "text", "json_schema": None})),
    ("/v1/completions", "response_format", _with(_COMPLETION, response_format={"type": "json_object"}),
     _with(_COMPLETION, response_format={"type": "bogus"})),
    ("/v1/chat/completions", "response_format.json_schema", _with(_CHAT, response_format={
        "type": "json_schema", "json_schema": {"name": "a", "schema": {"type": "object"}, "strict": None}}),
     _with(_CHAT, response_format={"type": "json_schema", "json_schema": {"name": "a", "schema": {}, "x": 1}})),
    ("/v1/chat/completions", "response_format.json_schema.schema", _with(_CHAT, response_format={
        "type": "json_schema", "json_schema": {"name": "a", "schema": {"type": "object"}, "description": "d"}}),
     _with(_CHAT, response_format={"type": "json_schema", "json_schema": {"name": "a"}})),
]


def _validator(document: dict[str, Any], path: str) -> Any:
    return jsonschema.Draft202012Validator({**document, **document["components"]["schemas"][_MODELS[path]]})


@pytest.mark.parametrize(("path", "param", "edge", "past"), _EDGES, ids=[f"{case[0]}:{case[1]}" for case in _EDGES])
def test_the_edge_is_taken_and_the_value_past_it_refused_by_both(
        client: TestClient, document: dict[str, Any], path: str, param: str, edge: dict[str, Any],
        past: dict[str, Any]) -> None:
    validator = _validator(document, path)
    answer = client.post(path, json=edge)
    assert answer.status_code == 200, answer.text
    validator.validate(edge)
    assert_error(client.post(path, json=past), 400, param)
    assert not validator.is_valid(past), past


def test_every_native_range_is_the_one_sampling_params_checks(document: dict[str, Any]) -> None:
    """The native schema reads SamplingParams' own ranges (no copy of them to drift)."""
    from lightllm.common.sampling.sampling_params import SAMPLING_RANGES

    properties = document["components"]["schemas"]["NativeParameters"]["properties"]
    published = 0
    for name, bounds in SAMPLING_RANGES.items():
        if name not in properties:
            continue  # a SamplingParams field /generate names otherwise (exponential_decay_*, prompt_logprobs)
        prop = properties[name]
        if name == "stop_token_ids":
            prop = next(option for option in prop["anyOf"] if option.get("type") == "array")["items"]
        else:
            prop = {**prop, **next((option for option in prop.get("anyOf", ()) if option.get("type") != "null"), {})}
        assert {key: prop[key] for key in bounds.json_schema()} == bounds.json_schema(), name
        published += 1
    assert published >= 12


@pytest.mark.parametrize(("path", "body", "field"), [
    ("/v1/completions", _with(_COMPLETION, top_p=1e-300), "top_p"),
    ("/v1/chat/completions", _with(_CHAT, temperature=1e-39), "temperature"),
    ("/generate", _native(temperature=1e-39), "temperature"),
    ("/generate", _native(repetition_penalty=1e-300), "repetition_penalty"),
])
def test_the_32_bit_float_rule_is_stated_where_no_keyword_can_state_it(
        client: TestClient, document: dict[str, Any], path: str, body: dict[str, Any], field: str) -> None:
    """A value too small for a 32-bit float is refused; an exclusiveMinimum of 0 cannot say so and a
    minimum of the smallest float32 would refuse values that round up to it, so the schema says it in words."""
    param = f"parameters.{field}" if path == "/generate" else field
    error = assert_error(client.post(path, json=body), 400, param)
    assert "32-bit float" in error["message"]
    schemas = document["components"]["schemas"]
    model = schemas["NativeParameters" if path == "/generate" else _MODELS[path]]
    assert "32-bit float" in model["properties"][field]["description"]
    assert "1.1754943508222875e-38" in model["properties"][field]["description"]


@pytest.mark.parametrize(("path", "body", "model", "field"), [
    ("/v1/completions", _with(_COMPLETION, stop=["x" * 600, "y" * 600]), "CompletionRequest", "stop"),
    ("/generate", _native(stop_sequences=["x" * 600, "y" * 600]), "NativeParameters", "stop_sequences"),
])
def test_the_stop_strings_byte_limit_is_stated(client: TestClient, document: dict[str, Any], path: str,
                                               body: dict[str, Any], model: str, field: str) -> None:
    """Two 600-character strings fit every keyword and not the 1024 bytes the record holds."""
    param = f"parameters.{field}" if path == "/generate" else field
    assert "1024 bytes" in assert_error(client.post(path, json=body), 400, param)["message"]
    assert "1024 bytes" in document["components"]["schemas"][model]["properties"][field]["description"]


def test_suffix_and_max_tokens_publish_what_each_endpoint_takes(document: dict[str, Any]) -> None:
    schemas = document["components"]["schemas"]
    assert {key: value for key, value in schemas["CompletionRequest"]["properties"]["suffix"].items()
            if key not in ("title", "default", "description")} == {"type": "null"}
    assert schemas["CompletionRequest"]["properties"]["max_tokens"]["minimum"] == 0
    assert schemas["ChatCompletionRequest"]["properties"]["max_tokens"]["minimum"] == 1
