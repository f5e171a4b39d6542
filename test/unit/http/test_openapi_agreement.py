"""The truthfulness of /openapi.json: it lists error bodies and event streams, and its schemas refuse
what the validation refuses (bodies a schema-driven fuzzer could generate) and let through what it takes.

The app is the real ``create_app`` over the scripted manager of ``api_fakes``.
"""

from __future__ import annotations

import re

import pytest
from fastapi.testclient import TestClient

from lightllm.server.http.service.health import PROBE_PATHS


def test_openapi_lists_error_bodies_and_event_streams(client: TestClient) -> None:
    document = client.get("/openapi.json").json()
    error_ref = {"$ref": "#/components/schemas/ErrorResponse"}
    assert document["components"]["schemas"]["ErrorResponse"]["required"] == ["error"]
    for path, operations in document["paths"].items():
        for method, operation in operations.items():
            responses = operation["responses"]
            assert "422" not in responses, path  # bodies are validated into 400s
            # No key configured: nothing answers 401, so no operation lists it.
            assert "401" not in responses, path
            if path in PROBE_PATHS:
                statuses = {"500", "503"}  # 503 is a probe's "no"
            else:
                statuses = {"500"} | ({"400", "404", "413", "503"} if method == "post" else set())
            for status in statuses:
                assert responses[status]["content"]["application/json"]["schema"] == error_ref, (path, status)
    for path in ("/v1/completions", "/v1/chat/completions"):
        content = document["paths"][path]["post"]["responses"]["200"]["content"]
        assert set(content) == {"application/json", "text/event-stream"}
    assert set(document["paths"]["/generate_stream"]["post"]["responses"]["200"]["content"]) == {"text/event-stream"}
    assert "text/event-stream" not in document["paths"]["/generate"]["post"]["responses"]["200"]["content"]


# Bodies the server refuses that a schema-driven fuzzer could generate: the schema must refuse them too.
_REFUSED_BODIES = {
    "/v1/completions": [
        {"prompt": ""}, {"prompt": []}, {"prompt": [""]}, {"prompt": [[]]}, {"prompt": "x", "stop": [""]},
        {"prompt": "x", "n": 0}, {"prompt": "x", "logprobs": 21}, {"prompt": "x", "logit_bias": {"1": 101}},
        {"prompt": "x", "logit_bias": {"a": 1}}, {"prompt": "x", "logit_bias": {"5.0": 1}},
        {"prompt": "x", "logit_bias": {"0x5": 1}}, {"prompt": "x", "truncate_prompt_tokens": 0},
        {"prompt": "x", "store": True}, {"prompt": "x", "service_tier": "flex"},
        {"prompt": "x", "structured_outputs": {}}, {"prompt": "x", "guided_choice": []},
        {"prompt": "x", "structured_outputs": {"structural_tag": None}},
        {"prompt": "x", "structured_outputs": {"structural_tag": "{}", "regex": "a"}},
        {"prompt": "x", "structured_outputs": {"regex": "a", "json_object": True}},
        {"prompt": "x", "structured_outputs": {"regex": "a", "_backend": 5}},
        {"prompt": "x", "structured_outputs": {"regex": "a", "whitespace_pattern": " "}},
        {"prompt": "x", "structured_outputs": {"regex": "a", "disable_additional_properties": True}},
        {"prompt": "x", "structured_outputs": {"regex": "a", "_backend_was_auto": "no"}},
        {"prompt": ["x"] * 65}, {"prompt": "x", "foo": None}, {"prompt": "x", "max_tokens": 5.5},
    ],
    "/v1/chat/completions": [
        {"messages": []}, {"messages": [{"role": "", "content": "x"}]},
        {"messages": [{"role": "robot", "content": "x"}]},
        {"messages": [{"role": "user", "content": "x"}], "top_logprobs": 21, "logprobs": True},
        {"messages": [{"role": "user", "content": "x"}], "chat_template": ""},
        # Not among vLLM 0.32's values ("xhigh" and "max" are: accepted below).
        {"messages": [{"role": "user", "content": "x"}], "reasoning_effort": "extreme"},
    ],
}
_ACCEPTED_BODIES = {
    "/v1/completions": [{"prompt": "x", "n": None, "logit_bias": {"5": -100}, "store": False, "metadata": None,
                         "service_tier": "auto", "truncate_prompt_tokens": 4, "structured_outputs": {"regex": "a"}},
                        # An integral float is an integer, to the server as to JSON Schema.
                        {"prompt": "x", "max_tokens": 5.0, "n": 2.0, "seed": 1.0},
                        # logit_bias keys as int() reads them, as vLLM reads them.
                        {"prompt": "x", "logit_bias": {" +05": 1}},
                        # null on a known key is absent, in the schema as on the server.
                        {"prompt": "x", "structured_outputs": {"structural_tag": None, "regex": "a", "json": None}},
                        {"prompt": "x", "structured_outputs": None},
                        # vLLM's own request model, dumped with exclude_none=True, sends its options.
                        {"prompt": "x", "structured_outputs": {
                            "json": {"type": "integer"}, "disable_any_whitespace": False,
                            "disable_additional_properties": False, "_backend_was_auto": False,
                            "whitespace_pattern": None}},
                        # vLLM's request model drops _backend on input: any string asks for nothing.
                        {"prompt": "x", "structured_outputs": {"regex": "a", "_backend": "xgrammar"}},
                        # int() reads other scripts' digits and white space: the schema lets them
                        # through (its pattern was ASCII-only and refused them).
                        {"prompt": "x", "logit_bias": {"\u0663": 1, "\uff15": 1, "\u00a07": 1, "1_0": 1,
                                                       "\U0001d7d6": 1, "\u20029\u3000": 1}}],
    "/v1/chat/completions": [{"messages": [{"role": "user", "content": "x"}], "prediction": None, "documents": None,
                              "top_logprobs": 20, "logprobs": True, "reasoning_effort": None},
                             {"messages": [{"role": "user", "content": "x"}], "reasoning_effort": "max"}],
}


def test_the_logit_bias_key_pattern_lets_through_every_ascii_character_int_reads(client: TestClient) -> None:
    """The schema refuses only ASCII characters int() never reads in a key (so never a key the server
    accepts); every other character is left to the server."""
    schema = client.get("/openapi.json").json()["components"]["schemas"]["CompletionRequest"]
    pattern = re.compile(schema["properties"]["logit_bias"]["propertyNames"]["pattern"])

    def int_reads(text: str) -> bool:
        try:
            int(text)
        except ValueError:
            return False
        return True

    for code in range(128):
        char = chr(code)
        read = any(int_reads(text) for text in (char + "5", "5" + char, "5" + char + "5"))
        assert bool(pattern.fullmatch("5" + char + "5")) == read, repr(char)


def test_openapi_schemas_agree_with_validation(client: TestClient) -> None:
    jsonschema = pytest.importorskip("jsonschema")
    document = client.get("/openapi.json").json()
    names = {"/v1/completions": "CompletionRequest", "/v1/chat/completions": "ChatCompletionRequest"}
    for path, name in names.items():
        validator = jsonschema.Draft202012Validator({**document, **document["components"]["schemas"][name]})
        for body in _REFUSED_BODIES[path]:
            assert client.post(path, json=body).status_code == 400, body
            assert not validator.is_valid(body), body
        for body in _ACCEPTED_BODIES[path]:
            assert client.post(path, json=body).status_code == 200, body
            validator.validate(body)
