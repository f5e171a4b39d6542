"""OpenAI-compatible endpoints: validation, error bodies and response shapes."""

from __future__ import annotations

import json
from typing import Any

import pytest
from fastapi.testclient import TestClient

from api_fakes import MODEL, FakeManager, assert_error, chat, completion, sse_events


# ---------------------------------------------------------------- /v1/completions


def test_completion_response_shape(client: TestClient, manager: FakeManager) -> None:
    response = completion(client, max_tokens=5, stop=["END"], temperature=0.5, seed=7)
    assert response.status_code == 200, response.text
    data = response.json()
    assert data["id"].startswith("cmpl-")
    assert data["object"] == "text_completion"
    assert data["model"] == MODEL
    assert isinstance(data["created"], int)
    assert data["choices"] == [{"index": 0, "text": " w0 w2", "logprobs": None, "finish_reason": "stop",
                                "stop_reason": None}]
    assert data["usage"] == {"prompt_tokens": 3, "completion_tokens": 3, "total_tokens": 6,
                             "prompt_tokens_details": {"cached_tokens": 2}}
    params = manager.calls[0].params
    assert params.stop_sequences == ["END"]
    assert params.max_new_tokens == 5 and params.temperature == 0.5 and params.seed == 7
    assert manager.calls[0].prompt_ids == manager.served.encode_prompt("hello there")
    assert manager.calls[0].high_priority is False


def test_completion_default_max_tokens_and_length_finish(client: TestClient, manager: FakeManager) -> None:
    manager.reply_len = 20
    data = completion(client).json()
    # Completions default to 16 tokens, as OpenAI and vLLM do.
    assert manager.calls[0].params.max_new_tokens == 16
    assert data["choices"][0]["finish_reason"] == "length"


def test_completion_multiple_prompts_times_n(client: TestClient, manager: FakeManager) -> None:
    data = completion(client, prompt=["one", "two words"], n=2, seed=5).json()
    assert [choice["index"] for choice in data["choices"]] == [0, 1, 2, 3]
    prompts_by_call = sorted((len(call.prompt_ids), call.params.seed) for call in manager.calls)
    assert prompts_by_call == [(2, 5), (2, 6), (3, 5), (3, 6)]
    assert data["usage"]["prompt_tokens"] == 2 + 3
    assert data["usage"]["completion_tokens"] == 4 * 3


def test_completion_token_id_prompts(client: TestClient, manager: FakeManager) -> None:
    assert completion(client, prompt=[5, 6, 7]).status_code == 200
    assert manager.calls[-1].prompt_ids == [5, 6, 7]
    data = completion(client, prompt=[[5], [6, 7]]).json()
    assert len(data["choices"]) == 2
    assert_error(completion(client, prompt=[5, 100]), 400, "prompt")
    assert_error(completion(client, prompt=[[5], [-1]]), 400, "prompt")


def test_completion_stream_chunks(client: TestClient) -> None:
    response = completion(client, stream=True, max_tokens=3, stream_options={"include_usage": True})
    assert response.status_code == 200
    events = sse_events(response)
    assert events[-1] == "[DONE]"
    usage_chunk, chunks = events[-2], events[:-2]
    assert usage_chunk["choices"] == []
    assert usage_chunk["usage"]["completion_tokens"] == 3 and usage_chunk["usage"]["total_tokens"] == 6
    # Token 1 has empty text and is not sent; the last token's chunk carries finish_reason.
    assert [chunk["choices"][0]["text"] for chunk in chunks] == [" w0", " w2"]
    assert [chunk["choices"][0]["finish_reason"] for chunk in chunks] == [None, "length"]
    assert all(chunk["usage"] is None and chunk["object"] == "text_completion" for chunk in chunks)
    assert len({chunk["id"] for chunk in events[:-1]}) == 1


def test_completion_stream_without_usage_and_with_n(client: TestClient) -> None:
    events = sse_events(completion(client, stream=True, n=2))
    assert events[-1] == "[DONE]"
    chunks = events[:-1]
    assert all("usage" not in chunk for chunk in chunks)
    for index in (0, 1):
        mine = [chunk["choices"][0] for chunk in chunks if chunk["choices"][0]["index"] == index]
        assert "".join(choice["text"] for choice in mine) == " w0 w2"
        assert mine[-1]["finish_reason"] == "stop" and all(c["finish_reason"] is None for c in mine[:-1])


def test_completion_logprobs_shape(client: TestClient, manager: FakeManager) -> None:
    data = completion(client, logprobs=2).json()
    assert manager.calls[0].params.logprobs == 2
    logprobs = data["choices"][0]["logprobs"]
    assert logprobs["tokens"] == ["<20>", "<21>", "<22>"]
    assert logprobs["token_logprobs"] == [-0.5, -0.5, -0.5]
    assert logprobs["text_offset"] == [0, 3, 3]
    assert logprobs["top_logprobs"][0] == {"<20>": -0.5, "<21>": -1.5}


def test_non_finite_logprobs_stay_valid_json(client: TestClient, manager: FakeManager) -> None:
    manager.token_logprob = float("-inf")
    response = completion(client, logprobs=0)
    assert response.status_code == 200
    assert response.json()["choices"][0]["logprobs"]["token_logprobs"] == [-9999.0] * 3
    events = sse_events(client.post("/generate_stream", json={"inputs": "hi"}))
    assert [event["token"]["logprob"] for event in events] == [-9999.0] * 3


@pytest.mark.parametrize(
    ("fields", "param"),
    [
        ({"temperature": -0.1}, "temperature"),
        ({"temperature": 2.5}, "temperature"),
        ({"temperature": "0.5"}, "temperature"),
        ({"top_p": 0}, "top_p"),
        ({"top_p": 1.5}, "top_p"),
        ({"max_tokens": 0}, "max_tokens"),
        ({"max_tokens": -3}, "max_tokens"),
        ({"max_tokens": 2.5}, "max_tokens"),
        ({"n": 0}, "n"),
        ({"n": 17}, "n"),
        ({"stop": [f"s{i}" for i in range(17)]}, "stop"),
        ({"stop": [""]}, "stop"),
        ({"stop": 3}, "stop"),
        ({"echo": "yes"}, "echo"),
        ({"min_p": 1.5}, "min_p"),
        ({"best_of": 17}, "best_of"),
        ({"n": 3, "best_of": 2}, "best_of"),
        ({"stream": True, "n": 1, "best_of": 2}, "best_of"),
        ({"prompt_logprobs": 21}, "prompt_logprobs"),
        ({"stream": True, "prompt_logprobs": 1}, "prompt_logprobs"),
        ({"request_id": "has space"}, "request_id"),
        ({"priority": 1}, "priority"),
        ({"suffix": "tail"}, "suffix"),
        ({"logprobs": 21}, "logprobs"),
        ({"stream": "yes"}, "stream"),
        ({"logit_bias": {"100": 1.0}}, "logit_bias"),
        ({"logit_bias": {"5": 100.5}}, "logit_bias"),
        ({"logit_bias": {"x": 1.0}}, "logit_bias"),
        ({"prompt": ""}, "prompt"),
        ({"prompt": []}, "prompt"),
        ({"prompt": [[]]}, "prompt"),
        ({"prompt": ["ok", 5]}, "prompt"),
        ({"prompt": None}, "prompt"),
        ({"stream_options": {"include_usage": True}}, "stream_options"),
        ({"stream": True, "stream_options": {"include_usage": True, "extra": 1}}, "stream_options.extra"),
        ({"min_tokens": 5, "max_tokens": 2}, "min_tokens"),
        ({"stop_token_ids": [100]}, "stop_token_ids"),
        ({"infer_high_priority": -1}, "infer_high_priority"),
    ],
)
def test_completion_invalid_fields(client: TestClient, manager: FakeManager, fields: dict[str, Any],
                                   param: str) -> None:
    assert_error(completion(client, **fields), 400, param)
    assert manager.calls == []


def test_missing_model_and_unknown_model(client: TestClient) -> None:
    # As vLLM: a request without model (or with null) is served by the one model.
    assert client.post("/v1/completions", json={"prompt": "x"}).json()["model"] == MODEL
    assert completion(client, model=None).json()["model"] == MODEL
    error = assert_error(completion(client, model="gpt-4"), 404, "model", "model_not_found")
    assert MODEL in error["message"]
    assert_error(chat(client, model="gpt-4"), 404, "model", "model_not_found")


def test_malformed_and_non_object_json(client: TestClient) -> None:
    headers = {"content-type": "application/json"}
    for path in ("/v1/completions", "/v1/chat/completions", "/generate", "/generate_stream"):
        error = assert_error(client.post(path, content=b'{"model": ', headers=headers), 400)
        assert "JSON" in error["message"]
        assert_error(client.post(path, content=b"[1, 2]", headers=headers), 400)
        assert_error(client.post(path, content=b"\xff\xfe", headers=headers), 400)


# ---------------------------------------------------------------- manager failures


@pytest.mark.parametrize("stream", [False, True])
def test_manager_errors_map_to_status(client: TestClient, manager: FakeManager, stream: bool) -> None:
    manager.failure = "busy"
    assert_error(completion(client, stream=stream), 503, code="server_busy")
    manager.failure = "reject"
    assert "refused" in assert_error(chat(client, stream=stream), 400)["message"]
    manager.failure = "crash"
    response = client.post("/generate_stream" if stream else "/generate", json={"inputs": "hi"})
    error = assert_error(response, 500, code="internal_error")
    assert "secret" not in response.text and "Traceback" not in response.text
    assert error["type"] == "server_error"


def test_failure_after_stream_started_is_reported_in_stream(client: TestClient, manager: FakeManager) -> None:
    manager.failure = "mid_stream"
    events = sse_events(completion(client, stream=True))
    assert events[0]["choices"][0]["text"] == " w0"
    assert events[-2]["error"]["type"] == "server_error" and "lost" not in json.dumps(events)
    assert events[-1] == "[DONE]"
    assert completion(client).status_code == 500


def test_finish_event_without_token(client: TestClient, manager: FakeManager) -> None:
    manager.failure = "finish_marker"
    data = completion(client, logprobs=1).json()
    assert data["choices"][0]["finish_reason"] == "stop"
    assert data["choices"][0]["logprobs"]["tokens"] == ["<20>", "<21>", "<22>"]
    chunks = sse_events(chat(client, stream=True, logprobs=True))[:-1]
    assert chunks[-1]["choices"][0] == {"index": 0, "delta": {"content": ""}, "logprobs": {"content": []},
                                        "finish_reason": "stop", "stop_reason": None}
    native = client.post("/generate", json={"inputs": "hi", "parameters": {"return_details": True}}).json()
    assert [token["id"] for token in native["details"]["tokens"]] == [20, 21, 22]
    assert native["count_output_tokens"] == 3 and native["finish_reason"] == "stop"


def test_generation_cut_off_without_finish_is_reported_as_abort(client: TestClient, manager: FakeManager) -> None:
    manager.failure = "vanish"
    assert completion(client).json()["choices"][0]["finish_reason"] == "abort"
    assert client.post("/generate", json={"inputs": "hi"}).json()["finish_reason"] == "abort"


# ---------------------------------------------------------------- /v1/chat/completions


def test_chat_response_shape(client: TestClient, manager: FakeManager) -> None:
    messages = [{"role": "developer", "content": "be brief"},
                {"role": "user", "content": [{"type": "text", "text": "a"}, {"type": "text", "text": "b"}]},
                {"role": "assistant", "content": None}, {"role": "user", "content": "go"}]
    data = chat(client, messages=messages, max_completion_tokens=6, max_tokens=2).json()
    assert data["id"].startswith("chatcmpl-") and data["object"] == "chat.completion"
    assert data["choices"] == [{"index": 0, "message": {"role": "assistant", "content": " w0 w2"},
                                "logprobs": None, "finish_reason": "stop", "stop_reason": None}]
    assert data["usage"]["completion_tokens"] == 3
    assert manager.served.chat_messages[0] == [{"role": "system", "content": "be brief"},
                                        {"role": "user", "content": "a\nb"},
                                        {"role": "assistant", "content": ""}, {"role": "user", "content": "go"}]
    assert manager.calls[0].params.max_new_tokens == 6


def test_chat_stream_chunks(client: TestClient) -> None:
    events = sse_events(chat(client, stream=True, n=2, max_tokens=3, stream_options={"include_usage": True}))
    assert events[-1] == "[DONE]"
    assert events[-2]["choices"] == [] and events[-2]["usage"]["completion_tokens"] == 6
    chunks = events[:-2]
    assert all(chunk["object"] == "chat.completion.chunk" and chunk["usage"] is None for chunk in chunks)
    for index in (0, 1):
        mine = [chunk["choices"][0] for chunk in chunks if chunk["choices"][0]["index"] == index]
        assert mine[0]["delta"] == {"role": "assistant", "content": ""}
        assert [choice["delta"] for choice in mine[1:]] == [{"content": " w0"}, {"content": " w2"}]
        assert [choice["finish_reason"] for choice in mine] == [None, None, "length"]


def test_chat_logprobs_shape(client: TestClient, manager: FakeManager) -> None:
    data = chat(client, logprobs=True, top_logprobs=2).json()
    assert manager.calls[0].params.logprobs == 2
    content = data["choices"][0]["logprobs"]["content"]
    assert len(content) == 3
    assert content[0] == {"token": "<20>", "logprob": -0.5, "bytes": list(b"<20>"),
                          "top_logprobs": [{"token": "<20>", "logprob": -0.5, "bytes": list(b"<20>")},
                                           {"token": "<21>", "logprob": -1.5, "bytes": list(b"<21>")}]}
    assert chat(client).json()["choices"][0]["logprobs"] is None
    assert manager.calls[-1].params.logprobs is None


@pytest.mark.parametrize(
    ("fields", "param"),
    [
        ({"messages": []}, "messages"),
        ({"messages": [{"role": "user", "content": "a"}, {"role": "wizard", "content": "b"}]}, "messages.1.role"),
        ({"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}]},
         "messages.0.content"),
        ({"messages": [{"role": "user", "content": 5}]}, "messages.0.content"),
        ({"messages": [{"role": "user"}]}, "messages.0.content"),
        ({"messages": [{"role": "user", "content": "a", "weight": 1}]}, "messages.0.weight"),
        ({"messages": [{"role": "assistant", "content": "", "tool_calls": [{"id": "1"}]}]}, "messages.0.tool_calls"),
        ({"messages": "hello"}, "messages"),
        ({"messages": [{"role": "user", "content": "BREAK_TEMPLATE"}]}, "messages"),
        ({"top_logprobs": 2}, "top_logprobs"),
        ({"logprobs": True, "top_logprobs": 21}, "top_logprobs"),
        ({"max_completion_tokens": 0}, "max_completion_tokens"),
        ({"tools": [{"type": "function"}]}, "tools.0"),
        ({"response_format": {"type": "xml"}}, "response_format"),
        ({"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "nonsense"}}}},
         "response_format.json_schema.schema"),
        ({"response_format": {"type": "json_schema", "json_schema": {"schema": {"type": "object"}}}},
         "response_format.json_schema.name"),
        ({"response_format": {"type": "json_schema", "json_schema": {"name": "bad name!", "schema": {}}}},
         "response_format.json_schema.name"),
        # "$" also matches before a final newline: the whole name must fit the pattern (OpenAI's rule).
        ({"response_format": {"type": "json_schema", "json_schema": {"name": "name\n", "schema": {}}}},
         "response_format.json_schema.name"),
        ({"response_format": {"type": "json_schema", "json_schema": {"name": "a", "schema": {}, "strict": "yes"}}},
         "response_format.json_schema.strict"),
        ({"response_format": {"type": "json_schema", "json_schema": {"name": "a", "schema": {}, "description": 5}}},
         "response_format.json_schema.description"),
        ({"response_format": {"type": "json_schema"}}, "response_format.json_schema"),
        ({"response_format": {"type": "json_schema", "json_schema": 5}}, "response_format.json_schema"),
        ({"response_format": {"type": "json_schema", "json_schema": {"name": "a", "schema": {}}, "x": 1}},
         "response_format"),
        # pydantic's names for the alternatives of a union (".str", ".list[...]") are not fields.
        ({"prediction": {"type": "content", "content": 5}}, "prediction.content"),
        ({"prediction": {"type": "content", "content": [{"type": "text", "text": 1}]}}, "prediction.content.0.text"),
        ({"stream_options": 5}, "stream_options"),
        ({"response_format": {"type": "json_object"}, "ignore_eos": True}, "ignore_eos"),
        ({"presence_penalty": 3}, "presence_penalty"),
        ({"top_k": -2}, "top_k"),
    ],
)
def test_chat_invalid_fields(client: TestClient, manager: FakeManager, fields: dict[str, Any], param: str) -> None:
    error = assert_error(chat(client, **fields), 400, param)
    if param == "messages.1.role":
        assert "wizard" in error["message"] and "messages.1.role" in error["message"]
    assert manager.calls == []


# ---------------------------------------------------------------- official client


def test_official_openai_client_parses_responses(client: TestClient) -> None:
    openai = pytest.importorskip("openai")
    sdk = openai.OpenAI(base_url="http://testserver/v1", api_key="unused", http_client=client, max_retries=0)
    assert [model.id for model in sdk.models.list()] == [MODEL]
    completion_result = sdk.completions.create(model=MODEL, prompt="hello", max_tokens=5, n=2)
    assert [choice.text for choice in completion_result.choices] == [" w0 w2", " w0 w2"]
    assert completion_result.usage.total_tokens == 2 + 6
    chunks = list(sdk.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "hi"}],
                                              stream=True, stream_options={"include_usage": True}))
    assert "".join(chunk.choices[0].delta.content or "" for chunk in chunks if chunk.choices) == " w0 w2"
    assert chunks[-1].usage.completion_tokens == 3
    with pytest.raises(openai.NotFoundError):
        sdk.chat.completions.create(model="other", messages=[{"role": "user", "content": "hi"}])
    with pytest.raises(openai.BadRequestError) as caught:
        sdk.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "hi"}], temperature=-1)
    assert caught.value.body["param"] == "temperature"


def test_response_format_json_reaches_the_sampling_params(client: TestClient, manager: FakeManager) -> None:
    schema = {"type": "object", "properties": {"ok": {"type": "boolean"}}, "required": ["ok"]}
    fmt = {"type": "json_schema", "json_schema": {"name": "answer", "schema": schema, "strict": True}}
    assert chat(client, response_format=fmt).status_code == 200
    assert manager.calls[-1].params.grammar is not None and "boolean" in manager.calls[-1].params.grammar
    assert chat(client, response_format={"type": "text"}).status_code == 200
    assert manager.calls[-1].params.grammar is None
