"""Hostile request bodies get 400s naming the client's field; the OpenAPI document describes bodies.

The app is the real ``create_app``; the request manager behind it is the scripted test double
from ``api_fakes`` (tests on a real server live in test/integration/test_request_validation.py).
"""

from __future__ import annotations

import json
from typing import Any

import pytest
from fastapi.testclient import TestClient

from api_fakes import MODEL, FakeManager, assert_error, chat, completion, sse_events

INT32_OVER = 2**31

POST_PATHS = ("/generate", "/generate_stream", "/v1/completions", "/v1/chat/completions")


def _raw_post(client: TestClient, path: str, raw: str) -> Any:
    return client.post(path, content=raw.encode("utf-8"), headers={"content-type": "application/json"})


# ---------------------------------------------------------------- stored-width numbers, both APIs


@pytest.mark.parametrize(
    ("fields", "param"),
    [
        ({"repetition_penalty": 1e39}, "repetition_penalty"),
        ({"repetition_penalty": 1e-300}, "repetition_penalty"),
        ({"top_p": 1e-300}, "top_p"),
        ({"temperature": 1e-300}, "temperature"),
        ({"presence_penalty": 1e-300}, "presence_penalty"),
        ({"frequency_penalty": -1e-300}, "frequency_penalty"),
        ({"top_k": 2**40}, "top_k"),
        ({"top_k": INT32_OVER}, "top_k"),
        ({"max_tokens": INT32_OVER}, "max_tokens"),
        ({"stop_token_ids": [INT32_OVER]}, "stop_token_ids"),
        ({"stop_token_ids": list(range(17))}, "stop_token_ids"),
        ({"stop": ["x" * 400, "y" * 400, "z" * 400]}, "stop"),
        ({"min_tokens": INT32_OVER}, "min_tokens"),
    ],
)
def test_completion_numbers_are_checked_in_their_stored_width(client: TestClient, manager: FakeManager,
                                                               fields: dict[str, Any], param: str) -> None:
    error = assert_error(completion(client, **fields), 400, param)
    assert error["message"].startswith(f"{param} must"), error
    assert "stop_sequences" not in error["message"] and "max_new_tokens" not in error["message"]
    assert manager.calls == []


@pytest.mark.parametrize(
    ("fields", "param"),
    [
        ({"max_completion_tokens": INT32_OVER}, "max_completion_tokens"),
        ({"max_tokens": INT32_OVER}, "max_tokens"),
        ({"top_k": INT32_OVER}, "top_k"),
        ({"repetition_penalty": 1e300}, "repetition_penalty"),
        ({"stop": ["é" * 200]}, "stop"),
    ],
)
def test_chat_numbers_name_the_chat_fields(client: TestClient, manager: FakeManager, fields: dict[str, Any],
                                           param: str) -> None:
    error = assert_error(chat(client, **fields), 400, param)
    assert error["message"].startswith(f"{param} must")
    assert manager.calls == []


def test_zero_max_tokens_offers_echo_only_where_echo_exists(client: TestClient, manager: FakeManager) -> None:
    chat_error = assert_error(chat(client, max_tokens=0), 400, "max_tokens")
    completion_error = assert_error(completion(client, max_tokens=0), 400, "max_tokens")
    assert "echo" not in chat_error["message"], chat_error
    assert "echo=true" in completion_error["message"], completion_error
    assert manager.calls == []


@pytest.mark.parametrize("value", [-1, 0])
def test_max_tokens_below_one_is_refused_with_the_whole_rule(client: TestClient, manager: FakeManager,
                                                               value: int) -> None:
    """-1 said "greater than or equal to 0", and 0 was then refused too (it needs completions' echo).
    Both are worded as the endpoint's other range errors (``Invalid value for 'temperature': ...``);
    0 said "max_tokens must be >= 1" without that prefix or the value."""
    completion_error = assert_error(completion(client, max_tokens=value), 400, "max_tokens")
    assert completion_error["message"] == \
        f"Invalid value for 'max_tokens': must be >= 1 (0 is allowed only with echo=true), got {value}"
    chat_error = assert_error(chat(client, max_tokens=value), 400, "max_tokens")
    assert chat_error["message"] == f"Invalid value for 'max_tokens': must be >= 1, got {value}"
    assert manager.calls == []


@pytest.mark.parametrize("value", [-1, 0])
def test_max_completion_tokens_below_one_reads_as_max_tokens(client: TestClient, manager: FakeManager,
                                                             value: int) -> None:
    """It said pydantic's "Input should be greater than or equal to 1" beside max_tokens' wording."""
    error = assert_error(chat(client, max_completion_tokens=value), 400, "max_completion_tokens")
    assert error["message"] == f"Invalid value for 'max_completion_tokens': must be >= 1, got {value}"
    assert manager.calls == []


@pytest.mark.parametrize(
    ("parameters", "param"),
    [
        ({"temperature": 1e39}, "parameters.temperature"),
        ({"temperature": 1e300}, "parameters.temperature"),
        ({"repetition_penalty": 1e300}, "parameters.repetition_penalty"),
        ({"repetition_penalty": 1e-300}, "parameters.repetition_penalty"),
        ({"top_p": 1e-300}, "parameters.top_p"),
        ({"top_k": INT32_OVER}, "parameters.top_k"),
        ({"max_new_tokens": INT32_OVER}, "parameters.max_new_tokens"),
        ({"min_new_tokens": INT32_OVER}, "parameters.min_new_tokens"),
        ({"seed": 2**63}, "parameters.seed"),
        ({"stop_token_ids": [INT32_OVER]}, "parameters.stop_token_ids"),
        ({"stop_sequences": ["x" * 1100]}, "parameters.stop_sequences"),
    ],
)
@pytest.mark.parametrize("path", ["/generate", "/generate_stream"])
def test_native_numbers_are_checked_in_their_stored_width(client: TestClient, manager: FakeManager,
                                                          parameters: dict[str, Any], param: str, path: str) -> None:
    error = assert_error(client.post(path, json={"inputs": "hi", "parameters": parameters}), 400, param)
    assert error["message"].startswith(f"{param} must")
    assert manager.calls == []


def test_values_at_the_storage_limits_are_accepted(client: TestClient, manager: FakeManager) -> None:
    assert completion(client, top_k=2**31 - 1, repetition_penalty=3.0e38, seed=2**63 - 1).status_code == 200
    body = {"inputs": "hi", "parameters": {"temperature": 1.2e-38, "top_p": 1.2e-38, "repetition_penalty": 1e-37}}
    assert client.post("/generate", json=body).status_code == 200
    assert [call.params.top_k for call in manager.calls] == [2**31 - 1, -1]


# ---------------------------------------------------------------- strings and structure


@pytest.mark.parametrize(
    ("path", "raw", "param"),
    [
        ("/v1/completions", '{"model": "%s", "prompt": "a\\ud800b"}' % MODEL, "prompt"),
        ("/v1/completions", '{"model": "%s", "prompt": ["ok", "\\udfff"]}' % MODEL, "prompt.1"),
        ("/v1/completions", '{"model": "\\ud800", "prompt": "x"}', "model"),
        ("/v1/completions", '{"model": "%s", "prompt": "x", "stop": "\\ud83d"}' % MODEL, "stop"),
        ("/v1/chat/completions", '{"model": "%s", "messages": [{"role": "user", "content": "\\ud800"}]}' % MODEL,
         "messages.0.content"),
        ("/v1/chat/completions",
         '{"model": "%s", "messages": [{"role": "user", "content": [{"type": "text", "text": "\\udc00"}]}]}' % MODEL,
         "messages.0.content.0.text"),
        ("/generate", '{"inputs": "\\ud800"}', "inputs"),
        ("/generate_stream", '{"inputs": "ok", "parameters": {"stop_sequences": ["\\ud800"]}}',
         "parameters.stop_sequences.0"),
        ("/generate", '{"inputs": "ok", "parameters": {"\\ud800": 1}}', "parameters"),
        ("/generate", '{"\\ud800": 1, "inputs": "ok"}', None),
    ],
)
def test_lone_surrogates_are_refused_naming_the_field(client: TestClient, manager: FakeManager, path: str, raw: str,
                                                      param: str | None) -> None:
    error = assert_error(_raw_post(client, path, raw), 400, param)
    assert "surrogate" in error["message"]
    assert manager.calls == []


def test_valid_unicode_passes(client: TestClient, manager: FakeManager) -> None:
    # Emoji (a surrogate pair in JSON escapes), RTL text, NUL and combining marks are fine.
    raw = '{"model": "%s", "prompt": "\\ud83d\\ude00 \\u05e9\\u05dc\\u05d5\\u05dd \\u0000 e\\u0301"}' % MODEL
    assert _raw_post(client, "/v1/completions", raw).status_code == 200
    assert len(manager.calls) == 1


# Near Python's recursion limit json.loads may or may not give up before the walk that names the
# field runs, depending on how deep the handler's stack already is; when it gives up, the field is
# read from the raw text instead, so every depth names it.
@pytest.mark.parametrize("depth", [33, 200, 1000, 100_000])
@pytest.mark.parametrize("path", POST_PATHS)
def test_deep_nesting_is_a_400(client: TestClient, path: str, depth: int) -> None:
    raw = '{"a": [[1]], "s": "[[[{", "x": ' + "[" * depth + "]" * depth + "}"
    error = assert_error(_raw_post(client, path, raw), 400, "x")
    assert "nested more than 32 levels" in error["message"]


def test_nesting_within_the_limit_reaches_field_validation(client: TestClient) -> None:
    raw = '{"inputs": "hi", "multimodal_params": {"a": ' + "[" * 30 + "]" * 30 + "}}"
    assert _raw_post(client, "/generate", raw).status_code == 400  # multimodal_params: not supported
    assert "multimodal" in _raw_post(client, "/generate", raw).json()["error"]["message"]


def test_overlong_integer_literal_is_a_400(client: TestClient) -> None:
    raw = '{"model": "%s", "prompt": "x", "top_k": %s}' % (MODEL, "9" * 5000)
    error = assert_error(_raw_post(client, "/v1/completions", raw), 400, "top_k")
    # The field and the limit in plain words, not Python's advice to call sys.set_int_max_str_digits().
    assert "more than 4300 digits" in error["message"] and "sys." not in error["message"]
    nested = '{"model": "%s", "prompt": "x", "x": [1.5, {"y": -%s}]}' % (MODEL, "9" * 5000)
    assert assert_error(_raw_post(client, "/v1/completions", nested), 400, "x")


# ---------------------------------------------------------------- generations per request


def test_one_request_may_not_hold_more_generations_than_the_manager_allows(client: TestClient,
                                                                          manager: FakeManager) -> None:
    """64 prompts x n 16 took every request slot of a default server: other clients waited minutes."""
    manager.max_generations_per_request = 8
    prompts = ["a", "b", "c"]
    error = assert_error(completion(client, prompt=prompts, n=3), 400, "n")
    assert "9 generations (3 prompts x n 3)" in error["message"] and "at most 8" in error["message"]
    error = assert_error(completion(client, prompt=prompts, n=2, best_of=3), 400, "best_of")
    assert "(3 prompts x best_of 3)" in error["message"]
    # One generation per prompt is already too many: the prompt count is what to change.
    error = assert_error(completion(client, prompt=["p"] * 9), 400, "prompt")
    assert error["message"].endswith("send fewer prompts per request")
    # Generations asking for top logprobs also hold a top-logprob row each: half of those rows.
    manager.max_top_logprob_generations_per_request = 2
    error = assert_error(completion(client, prompt=prompts[:1], n=3, logprobs=1), 400, "n")
    assert "at most 2 (half of the server's top-logprob rows (--top_logprobs_slots), at least 1)" in error["message"]
    assert not manager.calls  # refused before anything ran
    assert completion(client, prompt=prompts[:1], n=3, logprobs=0).status_code == 200
    assert completion(client, prompt=prompts[:2], n=4).status_code == 200
    assert len(manager.calls) == 11


def test_chat_and_generate_hold_to_the_same_caps(client: TestClient, manager: FakeManager) -> None:
    """Only /v1/completions checked them: chat n 8 with top_logprobs on a PD master got a 503 from
    the decode node (after the busy retry), a normal server with 2 rows served chat n 16 (outside pass)."""
    manager.max_generations_per_request, manager.max_top_logprob_generations_per_request = 8, 2
    messages = [{"role": "user", "content": "x"}]
    error = assert_error(chat(client, messages=messages, n=9), 400, "n")
    assert "9 generations (n 9)" in error["message"] and error["message"].endswith("use a smaller n")
    error = assert_error(chat(client, messages=messages, n=3, logprobs=True, top_logprobs=1), 400, "n")
    assert "at most 2 (half of the server's top-logprob rows" in error["message"]
    assert_error(chat(client, messages=messages, n=3, prompt_logprobs=1), 400, "n")
    generate = {"inputs": "x", "parameters": {"n": 3, "best_of": 3, "do_sample": True, "logprobs": 1,
                                              "return_details": True}}
    error = assert_error(client.post("/generate", json=generate), 400, "parameters.n")
    assert "at most 2" in error["message"]
    generate["parameters"] = {**generate["parameters"], "n": 2}
    assert_error(client.post("/generate", json=generate), 400, "parameters.best_of")
    assert not manager.calls  # refused before anything ran
    # Within the caps, or without top logprobs (logprobs true alone is the chosen token's, no row):
    assert chat(client, messages=messages, n=3, logprobs=True).status_code == 200
    assert chat(client, messages=messages, n=2, logprobs=True, top_logprobs=1).status_code == 200
    assert client.post("/generate", json={"inputs": "x", "parameters": {"n": 2, "do_sample": True}}).status_code == 200


# ---------------------------------------------------------------- a request the rank finished with an error


def test_rank_error_is_a_500_for_non_streaming_clients(client: TestClient, manager: FakeManager) -> None:
    manager.failure = "rank_error"
    for response in (completion(client), chat(client), client.post("/generate", json={"inputs": "hi"})):
        error = assert_error(response, 500, None, "generation_failed")
        assert error["type"] == "server_error"


def test_rank_error_ends_a_stream_with_an_error_event(client: TestClient, manager: FakeManager) -> None:
    manager.failure = "rank_error"
    events = sse_events(completion(client, stream=True))
    assert [event["choices"][0]["text"] for event in events[:2]] == [" w0", " w2"]
    assert events[-2]["error"]["code"] == "generation_failed" and events[-1] == "[DONE]"
    assert not any(isinstance(event, dict) and event.get("choices", [{}])[0].get("finish_reason") for event in events)
    native = sse_events(client.post("/generate_stream", json={"inputs": "hi"}))
    assert native[-1]["error"]["code"] == "generation_failed"
    # The last token arrived with the error: its text is still delivered before the error.
    assert [event["token"]["id"] for event in native[:-1]] == [20, 21, 22]
    assert all(event["finished"] is False for event in native[:-1])


def test_a_grammar_that_could_not_go_on_is_the_clients_400_not_a_server_failure(client: TestClient,
                                                                                manager: FakeManager) -> None:
    """A recursive schema that requires nesting was a 500 generation_failed: the same request always
    fails again, and a client that retries 500s retried it for ever."""
    manager.failure = "grammar_failed"
    for response in (completion(client), chat(client), client.post("/generate", json={"inputs": "hi"})):
        error = assert_error(response, 400, None, "grammar_failed")
        assert error["type"] == "invalid_request_error" and "grammar" in error["message"]
    events = sse_events(completion(client, stream=True))
    assert [event["choices"][0]["text"] for event in events[:2]] == [" w0", " w2"]
    assert events[-2]["error"]["code"] == "grammar_failed" and events[-1] == "[DONE]"
    native = sse_events(client.post("/generate_stream", json={"inputs": "hi"}))
    assert native[-1]["error"]["code"] == "grammar_failed"


# ---------------------------------------------------------------- OpenAPI request bodies


def test_openapi_describes_every_post_body(client: TestClient) -> None:
    jsonschema = pytest.importorskip("jsonschema")
    document = client.get("/openapi.json").json()
    schemas = document["components"]["schemas"]
    expected = {"/generate": "NativeGenerateRequest", "/generate_stream": "NativeGenerateRequest",
                "/v1/completions": "CompletionRequest", "/v1/chat/completions": "ChatCompletionRequest"}
    valid = {
        "/generate": {"inputs": "hi", "parameters": {"max_new_tokens": 2, "stop_sequences": ["\n"]}},
        "/generate_stream": {"inputs": "hi"},
        "/v1/completions": {"model": MODEL, "prompt": [[1, 2, 3]], "max_tokens": 2, "stop": "x"},
        "/v1/chat/completions": {"model": MODEL, "messages": [{"role": "user", "content": [{"type": "text",
                                                                                         "text": "hi"}]}]},
    }
    for path, model_name in expected.items():
        body = document["paths"][path]["post"]["requestBody"]
        assert body["required"] is True
        ref = body["content"]["application/json"]["schema"]["$ref"]
        assert ref == f"#/components/schemas/{model_name}"
        # Resolve every $ref against the whole document, as fuzzers and generators do.
        resolver_doc = {**document, **schemas[model_name]}
        validator = jsonschema.Draft202012Validator(resolver_doc)
        validator.validate(valid[path])
        assert client.post(path, json=valid[path]).status_code == 200, path
        with pytest.raises(jsonschema.ValidationError):
            validator.validate({**valid[path], "no_such_field": 1})
    messages = schemas["ChatCompletionRequest"]["properties"]["messages"]
    assert messages["items"] == {"$ref": "#/components/schemas/ChatMessage"}
    # Storage widths are stated in the document, so generators do not produce values we refuse.
    assert schemas["CompletionRequest"]["properties"]["top_k"]["maximum"] == 2**31 - 1
    assert schemas["NativeParameters"]["properties"]["max_new_tokens"]["maximum"] == 2**31 - 1
    assert schemas["NativeParameters"]["properties"]["seed"]["maximum"] == 2**63 - 1
    assert schemas["NativeParameters"]["properties"]["temperature"]["maximum"] == pytest.approx(3.4028234663852886e38)


def test_openapi_document_is_json_serialisable_and_stable(client: TestClient) -> None:
    first = client.get("/openapi.json").json()
    assert json.dumps(first) == json.dumps(client.get("/openapi.json").json())


# ---------------------------------------------------------------- vLLM's readings of seed and stop


@pytest.mark.parametrize("post", [completion, chat])
def test_seed_minus_one_means_no_seed_as_in_vllm(client: TestClient, manager: FakeManager, post: Any) -> None:
    assert post(client, seed=-1, temperature=1.0).status_code == 200
    assert manager.calls[-1].params.seed is None
    assert_error(post(client, seed=-2), 400, "seed")
    # Above int64: the refusal states the range with the -1 these endpoints take.
    for seed in (2**63, 2**64):
        error = assert_error(post(client, seed=seed), 400, "seed")
        assert "must be -1 (no seed) or in [0, 2**63 - 1]" in error["message"]
    assert not manager.calls[1:]


@pytest.mark.parametrize("post", [completion, chat])
def test_lm_eval_code_tasks_stop_lists_are_taken(client: TestClient, manager: FakeManager, post: Any) -> None:
    # humaneval's `until` in lm-eval 0.4: six strings (OpenAI itself takes four).
    until = ["\nclass", "\ndef", "\n#", "\nif", "\nprint", "</s>"]
    assert post(client, stop=until).status_code == 200
    assert manager.calls[-1].params.stop_sequences == until
    assert_error(post(client, stop=[f"s{i}" for i in range(17)]), 400, "stop")


@pytest.mark.parametrize("post", [completion, chat])
def test_vllm_fields_at_their_defaults_are_taken_and_other_values_refused_saying_why(
        client: TestClient, manager: FakeManager, post: Any) -> None:
    defaults = {"use_beam_search": False, "length_penalty": 1.0, "priority": 0}
    assert post(client, **defaults).status_code == 200
    assert post(client, length_penalty=1, priority=0.0, use_beam_search=None).status_code == 200
    for field, value, why in [("use_beam_search", True, "beam search is not supported"),
                              ("length_penalty", 0.8, "only weighs beams"),
                              ("priority", 1, "native /generate and /generate_stream only")]:
        error = assert_error(post(client, **{field: value}), 400, field)
        assert why in error["message"] and "vLLM's default" in error["message"], error
    # A value of another type is a type error (test_api_vllm_request_fields), not "not supported".
    for field, value in [("use_beam_search", 0), ("priority", False)]:
        error = assert_error(post(client, **{field: value}), 400, field)
        assert "Input should be a valid" in error["message"] and "vLLM's default" not in error["message"], error


def test_a_server_of_one_or_two_places_still_runs_one_generation_per_request() -> None:
    from lightllm.server.request_manager import generations_per_request

    # --top_logprobs_slots 1 gave a limit of 0: every request asking for top logprobs was refused.
    assert [generations_per_request(places) for places in (1, 2, 3, 256, 1024)] == [1, 1, 1, 128, 512]
