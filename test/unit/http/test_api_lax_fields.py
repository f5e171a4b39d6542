"""Where the request schemas are lenient and where they are not: integral floats in integer fields are
integers (as vLLM's lax models take them), a null unknown field is still unknown, and ``stream_options``
that would do nothing is refused."""

from __future__ import annotations

from typing import Any

import pytest
from fastapi.testclient import TestClient

from api_fakes import FakeManager, assert_error, chat, completion, sse_events

# ---------------------------------------------------------------- unknown fields, whatever their value


@pytest.mark.parametrize("value", [None, False, 0, "", {}])
def test_an_unknown_field_is_refused_whatever_its_value(client: TestClient, manager: FakeManager,
                                                        value: Any) -> None:
    for response in (completion(client, max_tokens=2, foo=value), chat(client, max_tokens=2, foo=value)):
        error = assert_error(response, 400, "foo")
        assert "Unknown parameter 'foo'" in error["message"]
    error = assert_error(completion(client, stream=True, stream_options={"include_usage": True, "bar": value}),
                         400, "stream_options.bar")
    assert "Unknown parameter" in error["message"]
    assert_error(client.post("/generate", json={"inputs": "hi", "foo": value}), 400, "foo")
    assert_error(client.post("/generate", json={"inputs": "hi", "parameters": {"foo": value}}), 400, "parameters.foo")
    assert manager.calls == []


def test_known_fields_still_take_null(client: TestClient) -> None:
    assert completion(client, max_tokens=None, seed=None, stream_options=None).status_code == 200
    assert chat(client, tools=None, stream=True, stream_options={"include_usage": None}).status_code == 200


# ---------------------------------------------------------------- stream_options


def test_continuous_usage_stats_needs_include_usage(client: TestClient, manager: FakeManager) -> None:
    for options in ({"continuous_usage_stats": True}, {"continuous_usage_stats": True, "include_usage": False}):
        for send in (completion, chat):
            error = assert_error(send(client, stream=True, stream_options=options), 400,
                                 "stream_options.continuous_usage_stats")
            assert "include_usage" in error["message"]
    assert manager.calls == []
    # With include_usage every chunk carries the usage so far; false alone is just the default.
    events = sse_events(completion(client, stream=True, stream_options={"continuous_usage_stats": True,
                                                                        "include_usage": True}))
    assert all(event["usage"] is not None for event in events[:-1])
    assert completion(client, stream=True, stream_options={"continuous_usage_stats": False}).status_code == 200


def test_continuous_usage_is_per_choice_as_vllm_sends_it(client: TestClient, manager: FakeManager) -> None:
    """Each chunk's usage is its own choice's prompt and completion so far (vLLM); the final usage
    chunk is the request's total.  It summed every prompt and choice on every chunk."""
    manager.reply_len = 4
    options = {"continuous_usage_stats": True, "include_usage": True}
    events = sse_events(completion(client, prompt=["a b c", "d"], n=2, max_tokens=4, stream=True,
                                   stream_options=options))
    prompt_tokens = {0: 4, 1: 4, 2: 2, 3: 2}  # BOS + one token per word, two choices per prompt
    seen: dict[int, list[int]] = {index: [] for index in prompt_tokens}
    for event in events[:-2]:
        index, usage = event["choices"][0]["index"], event["usage"]
        assert usage["prompt_tokens"] == prompt_tokens[index], event
        assert usage["total_tokens"] == usage["prompt_tokens"] + usage["completion_tokens"]
        seen[index].append(usage["completion_tokens"])
    assert all(counts == sorted(counts) and counts[-1] == 4 for counts in seen.values()), seen
    assert events[-2]["usage"]["prompt_tokens"] == 6 and events[-2]["usage"]["completion_tokens"] == 16
    chat_events = sse_events(chat(client, n=2, max_tokens=4, stream=True, stream_options=options))
    openings = [event for event in chat_events[:-2] if event["choices"][0]["delta"].get("role")]
    assert len(openings) == 2 and all(event["usage"]["completion_tokens"] == 0 for event in openings)
    assert {event["usage"]["prompt_tokens"] for event in chat_events[:-2]} == {chat_events[-2]["usage"]["prompt_tokens"]}


@pytest.mark.parametrize("send", [completion, chat])
def test_every_chunk_reports_the_cached_prompt_tokens(client: TestClient, manager: FakeManager, send: Any) -> None:
    """The cached count is known once the prompt is prefilled, before the first token (and before any
    chunk: the generations are primed first); the role chunk said 0 while the later ones said the
    real count."""
    manager.cached_tokens = 3
    events = sse_events(send(client, n=2, max_tokens=3, stream=True,
                             stream_options={"continuous_usage_stats": True, "include_usage": True}))
    chunks = [event for event in events if event != "[DONE]"]
    assert len(chunks) > 3
    assert all(chunk["usage"]["prompt_tokens_details"] == {"cached_tokens": 3} for chunk in chunks[:-1]), chunks
    # The final usage chunk counts the prompt once for the request.
    assert chunks[-1]["choices"] == [] and chunks[-1]["usage"]["prompt_tokens_details"] == {"cached_tokens": 3}


def test_stream_options_without_streaming_is_refused_as_vllm_does(client: TestClient) -> None:
    for send in (completion, chat):
        for stream in (False, None):
            assert_error(send(client, stream=stream, stream_options={"include_usage": True}), 400, "stream_options")
            assert_error(send(client, stream=stream, stream_options={"include_usage": False}), 400, "stream_options")
        assert send(client, stream=False, stream_options=None).status_code == 200


def test_empty_stream_options_without_streaming_asks_for_nothing(client: TestClient) -> None:
    """vLLM refuses stream_options without stream only when the object is not empty (it tests truthiness)."""
    for send in (completion, chat):
        for fields in ({"stream": False}, {"stream": None}, {}):
            response = send(client, stream_options={}, **fields)
            assert response.status_code == 200, response.text
            assert response.headers["content-type"].startswith("application/json")
            assert response.json()["usage"]["total_tokens"] > 0
        # A null option is an absent one: the object is as empty.
        assert send(client, stream_options={"include_usage": None}).status_code == 200


# ---------------------------------------------------------------- integral floats in integer fields

# (fields sent, SamplingParams attribute, value it must hold) for each OpenAI endpoint.
_COMPLETION_INTEGERS = [
    ({"max_tokens": 5.0}, "max_new_tokens", 5),
    ({"seed": 1.0}, "seed", 1),
    ({"top_k": 3.0}, "top_k", 3),
    ({"top_k": -1.0}, "top_k", -1),
    ({"min_tokens": 1.0, "max_tokens": 4}, "min_new_tokens", 1),
    ({"logprobs": 2.0}, "logprobs", 2),
    ({"prompt_logprobs": 1.0}, "prompt_logprobs", 1),
    ({"stop_token_ids": [7.0, 8]}, "stop_token_ids", [7, 8]),
]
_CHAT_INTEGERS = [
    ({"max_completion_tokens": 4.0}, "max_new_tokens", 4),
    ({"max_tokens": 5.0}, "max_new_tokens", 5),
    ({"seed": 2.0}, "seed", 2),
    ({"logprobs": True, "top_logprobs": 3.0}, "logprobs", 3),
]


@pytest.mark.parametrize(("send", "fields", "attribute", "value"),
                         [(completion, *case) for case in _COMPLETION_INTEGERS] + [(chat, *case) for case in _CHAT_INTEGERS])
def test_integer_fields_take_integral_floats(client: TestClient, manager: FakeManager, send: Any,
                                             fields: dict[str, Any], attribute: str, value: Any) -> None:
    response = send(client, **fields)
    assert response.status_code == 200, response.text
    held = getattr(manager.calls[-1].params, attribute)
    assert held == value and type(held) is type(value)
    assert all(type(item) is int for item in held) if isinstance(held, list) else True


def test_counts_and_token_ids_take_integral_floats(client: TestClient, manager: FakeManager) -> None:
    assert len(completion(client, n=2.0).json()["choices"]) == 2
    assert len(completion(client, n=1, best_of=2.0).json()["choices"]) == 1
    assert len(chat(client, n=3.0).json()["choices"]) == 3
    assert completion(client, prompt=[[1.0, 2.0, 3.0]]).status_code == 200
    assert manager.calls[-1].prompt_ids == [1, 2, 3] and all(type(item) is int for item in manager.calls[-1].prompt_ids)
    assert completion(client, prompt=[4.0, 5]).status_code == 200 and manager.calls[-1].prompt_ids == [4, 5]
    response = completion(client, prompt="a b c d e f", truncate_prompt_tokens=2.0)
    assert response.status_code == 200 and response.json()["usage"]["prompt_tokens"] == 2


@pytest.mark.parametrize("value", [5.5, 1e-9, True, False, "5", 1e30])
@pytest.mark.parametrize("name", ["max_tokens", "seed", "n", "top_k", "min_tokens", "logprobs", "best_of",
                                  "prompt_logprobs", "truncate_prompt_tokens"])
def test_completions_refuse_other_non_integers_naming_the_field(client: TestClient, manager: FakeManager,
                                                                name: str, value: Any) -> None:
    assert_error(completion(client, **{name: value}), 400, name)
    assert manager.calls == []


@pytest.mark.parametrize(("fields", "param"), [
    ({"max_completion_tokens": 2.5}, "max_completion_tokens"), ({"max_tokens": True}, "max_tokens"),
    ({"logprobs": True, "top_logprobs": 1.5}, "top_logprobs"), ({"n": 2.5}, "n"),
    ({"stop_token_ids": [1.5]}, "stop_token_ids.0"), ({"stop_token_ids": [True]}, "stop_token_ids.0"),
])
def test_chat_refuses_other_non_integers_naming_the_field(client: TestClient, fields: dict[str, Any],
                                                          param: str) -> None:
    assert_error(chat(client, **fields), 400, param)


def test_completion_prompts_refuse_non_integral_token_ids(client: TestClient) -> None:
    for prompt in ([1.5, 2], [[1, 2.5]], [True, 2]):
        assert_error(completion(client, prompt=prompt), 400, "prompt")


def test_native_endpoints_take_integral_floats_too(client: TestClient, manager: FakeManager) -> None:
    parameters = {"max_new_tokens": 3.0, "min_new_tokens": 1.0, "top_k": 2.0, "seed": 7.0, "stop_token_ids": [9.0],
                  "exponential_decay_length_penalty": [2.0, 1.5], "return_details": True, "logprobs": 1.0}
    for path in ("/generate", "/generate_stream"):
        assert client.post(path, json={"inputs": "hi", "parameters": parameters}).status_code == 200
        params = manager.calls[-1].params
        assert (params.max_new_tokens, params.min_new_tokens, params.top_k, params.seed) == (3, 1, 2, 7)
        assert params.stop_token_ids == [9] and params.exponential_decay_start == 2 and params.logprobs == 1
        assert all(type(value) is int for value in (params.max_new_tokens, params.top_k, params.seed,
                                                    params.exponential_decay_start, *params.stop_token_ids))
    generated = client.post("/generate", json={"inputs": "hi", "parameters": {"n": 2.0, "best_of": 2.0}}).json()
    assert len(generated["generated_text"]) == 2
    for name, value in (("max_new_tokens", 2.5), ("seed", True), ("n", 1.5)):
        assert_error(client.post("/generate", json={"inputs": "hi", "parameters": {name: value}}), 400,
                     f"parameters.{name}")
    assert_error(client.post("/generate", json={"inputs": "hi", "parameters": {
        "exponential_decay_length_penalty": [2.5, 1.5]}}), 400, "parameters.exponential_decay_length_penalty")
