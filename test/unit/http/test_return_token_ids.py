"""vLLM's ``return_token_ids`` on ``/v1/completions`` and ``/v1/chat/completions``: where the prompt's and
each choice's token ids go in whole responses and streams, and how the field combines with ``n``,
``best_of``, several prompts, ``echo``, logprobs, truncation and tool calls.

The app is the real ``create_app`` over the scripted managers of ``api_fakes`` / ``scripted_manager``:
every FakeManager generation is tokens 20, 21, 22 with texts " w0", "" (a held-back piece), " w2".
The same field on a real server, against the tokenizer, is in
test/integration/api_compat/test_return_token_ids.py.
"""

from __future__ import annotations

from typing import Any

import pytest
from fastapi.testclient import TestClient

from api_fakes import FakeManager, assert_error, chat, completion, sse_events
from scripted_manager import make_client

GENERATED = [20, 21, 22]
WEATHER_TOOL = {"type": "function", "function": {
    "name": "get_weather", "parameters": {"type": "object", "properties": {"city": {"type": "string"}}}}}


def _chunks(response: Any) -> list[dict[str, Any]]:
    assert response.status_code == 200, response.text
    events = sse_events(response)
    assert events[-1] == "[DONE]"
    return events[:-1]


def _by_choice(chunks: list[dict[str, Any]]) -> dict[int, list[dict[str, Any]]]:
    """Each choice's chunks (with their top-level fields), in order."""
    grouped: dict[int, list[dict[str, Any]]] = {}
    for chunk in chunks:
        for choice in chunk["choices"]:
            grouped.setdefault(choice["index"], []).append({**chunk, "choice": choice})
    return grouped


# ---------------------------------------------------------------- completions


def test_completion_ids_per_choice_beside_unchanged_text(client: TestClient, manager: FakeManager) -> None:
    plain = completion(client, n=2).json()
    answer = completion(client, n=2, return_token_ids=True).json()
    prompt_ids = manager.served.encode_prompt("hello there")
    for choice, before in zip(answer["choices"], plain["choices"]):
        assert choice["prompt_token_ids"] == prompt_ids and choice["token_ids"] == GENERATED
        assert {key: value for key, value in choice.items() if not key.endswith("token_ids")} == before
    assert "prompt_token_ids" not in answer and answer["usage"] == plain["usage"]


@pytest.mark.parametrize("off", [{}, {"return_token_ids": False}, {"return_token_ids": None}])
def test_off_adds_nothing_and_streams_as_before(client: TestClient, off: dict[str, Any]) -> None:
    choice = completion(client, **off).json()["choices"][0]
    assert "token_ids" not in choice and "prompt_token_ids" not in choice
    chunks = _chunks(completion(client, stream=True, **off))
    # The token with no text sends no chunk when ids are not asked for.
    assert [chunk["choices"][0]["text"] for chunk in chunks] == [" w0", " w2"]
    assert not any("token_ids" in chunk["choices"][0] or "prompt_token_ids" in chunk["choices"][0] for chunk in chunks)
    chat_chunks = _chunks(chat(client, stream=True, **off))
    assert not any("prompt_token_ids" in chunk or "token_ids" in chunk["choices"][0] for chunk in chat_chunks)


@pytest.mark.parametrize("value", ["yes", 1, 0, "true", [True]])
def test_non_boolean_is_refused_naming_the_field(client: TestClient, value: Any) -> None:
    assert_error(completion(client, return_token_ids=value), 400, "return_token_ids")
    assert_error(chat(client, return_token_ids=value), 400, "return_token_ids")


def test_several_prompts_each_choice_has_its_own_prompt(client: TestClient, manager: FakeManager) -> None:
    answer = completion(client, prompt=["one two", "three"], n=2, return_token_ids=True).json()
    first, second = manager.served.encode_prompt("one two"), manager.served.encode_prompt("three")
    assert [choice["prompt_token_ids"] for choice in answer["choices"]] == [first, first, second, second]
    assert all(choice["token_ids"] == GENERATED for choice in answer["choices"])
    ids = completion(client, prompt=[[5, 6, 7], [8]], return_token_ids=True).json()
    assert [choice["prompt_token_ids"] for choice in ids["choices"]] == [[5, 6, 7], [8]]


def test_completion_stream_prompt_once_per_choice_and_token_deltas(client: TestClient, manager: FakeManager) -> None:
    chunks = _chunks(completion(client, prompt=["one two", "three"], n=2, stream=True, return_token_ids=True,
                                stream_options={"include_usage": True}))
    assert chunks[-1]["choices"] == [] and "prompt_token_ids" not in chunks[-1]  # the usage chunk
    first, second = manager.served.encode_prompt("one two"), manager.served.encode_prompt("three")
    prompts = {0: first, 1: first, 2: second, 3: second}
    grouped = _by_choice(chunks)
    assert sorted(grouped) == [0, 1, 2, 3]
    for index, mine in grouped.items():
        choices = [item["choice"] for item in mine]
        assert choices[0]["prompt_token_ids"] == prompts[index]
        assert all(choice["prompt_token_ids"] is None for choice in choices[1:])  # vLLM: null after the first
        # One chunk per token, the one without text included, so the deltas add up to the whole list.
        assert [choice["token_ids"] for choice in choices] == [[20], [21], [22]]
        assert [choice["text"] for choice in choices] == [" w0", "", " w2"]
        assert choices[-1]["finish_reason"] == "stop"


def test_completion_echo_keeps_the_prompt_text_and_ids_apart(client: TestClient, manager: FakeManager) -> None:
    prompt_ids = manager.served.encode_prompt("hello there")
    choice = completion(client, echo=True, return_token_ids=True).json()["choices"][0]
    # The echoed prompt is in the text (vLLM 0.32 drops it there with return_token_ids), not in token_ids.
    assert choice["text"] == "hello there w0 w2"
    assert choice["prompt_token_ids"] == prompt_ids and choice["token_ids"] == GENERATED
    # max_tokens 0: the prompt alone; the token run to finish the prefill is dropped from the ids too.
    alone = completion(client, echo=True, max_tokens=0, return_token_ids=True).json()
    assert alone["choices"][0]["text"] == "hello there" and alone["choices"][0]["token_ids"] == []
    assert alone["choices"][0]["prompt_token_ids"] == prompt_ids and alone["usage"]["completion_tokens"] == 0
    streamed = [chunk["choices"][0] for chunk in _chunks(completion(client, echo=True, max_tokens=0, stream=True,
                                                                    return_token_ids=True))]
    assert "".join(choice["text"] for choice in streamed) == "hello there"
    assert [token for choice in streamed for token in choice["token_ids"]] == []
    assert streamed[0]["prompt_token_ids"] == prompt_ids


def test_completion_logprobs_and_ids_agree(client: TestClient) -> None:
    choice = completion(client, logprobs=1, return_token_ids=True, return_tokens_as_token_ids=True).json()["choices"][0]
    assert choice["logprobs"]["tokens"] == [f"token_id:{token_id}" for token_id in choice["token_ids"]]


def test_best_of_keeps_the_ids_of_the_returned_choices(client: TestClient, manager: FakeManager) -> None:
    answer = completion(client, prompt=["one", "two"], n=1, best_of=3, return_token_ids=True).json()
    assert [choice["index"] for choice in answer["choices"]] == [0, 1]
    assert [choice["prompt_token_ids"] for choice in answer["choices"]] == [manager.served.encode_prompt("one"),
                                                                             manager.served.encode_prompt("two")]
    assert all(choice["token_ids"] == GENERATED for choice in answer["choices"])


def test_truncated_prompt_reports_the_ids_that_ran(client: TestClient, manager: FakeManager) -> None:
    choice = completion(client, prompt=[5, 6, 7, 8], truncate_prompt_tokens=2, return_token_ids=True).json()
    assert choice["choices"][0]["prompt_token_ids"] == [7, 8] == manager.calls[-1].prompt_ids


def test_finish_marker_chunk_carries_no_token(client: TestClient, manager: FakeManager) -> None:
    manager.failure = "finish_marker"  # the last token comes without a finish; a token-less event ends it
    choices = [chunk["choices"][0] for chunk in _chunks(completion(client, stream=True, return_token_ids=True))]
    assert [choice["token_ids"] for choice in choices] == [[20], [21], [22], []]
    assert choices[-1]["finish_reason"] == "stop"
    whole = completion(client, return_token_ids=True).json()["choices"][0]
    assert whole["token_ids"] == GENERATED


# ---------------------------------------------------------------- chat


def test_chat_prompt_ids_at_the_top_and_ids_per_choice(client: TestClient, manager: FakeManager) -> None:
    answer = chat(client, n=2, return_token_ids=True).json()
    assert answer["prompt_token_ids"] == manager.calls[-1].prompt_ids
    for choice in answer["choices"]:
        assert choice["token_ids"] == GENERATED and "prompt_token_ids" not in choice
        assert choice["message"]["content"] == " w0 w2"


def test_chat_stream_prompt_on_each_role_chunk_and_token_deltas(client: TestClient, manager: FakeManager) -> None:
    chunks = _chunks(chat(client, n=2, stream=True, return_token_ids=True, logprobs=True))
    for index, mine in _by_choice(chunks).items():
        role, *tokens = mine
        # As vLLM: the role chunk of each choice carries the prompt at the top level, no token_ids.
        assert role["choice"]["delta"]["role"] == "assistant" and "token_ids" not in role["choice"]
        assert role["prompt_token_ids"] == manager.calls[-1].prompt_ids
        assert all("prompt_token_ids" not in chunk for chunk in tokens)
        assert [chunk["choice"]["token_ids"] for chunk in tokens] == [[20], [21], [22]]
        assert [chunk["choice"]["delta"]["content"] for chunk in tokens] == [" w0", "", " w2"]
        assert [len(chunk["choice"]["logprobs"]["content"]) for chunk in tokens] == [1, 1, 1]


def test_chat_stream_without_logprobs_still_sends_every_token(client: TestClient) -> None:
    chunks = _chunks(chat(client, stream=True, return_token_ids=True))
    assert [token for chunk in chunks[1:] for token in chunk["choices"][0]["token_ids"]] == GENERATED


def test_chat_echo_ids_are_the_generated_ones(client: TestClient, manager: FakeManager) -> None:
    messages = [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "Sure:"}]
    answer = chat(client, messages=messages, echo=True, add_generation_prompt=False, continue_final_message=True,
                  return_token_ids=True).json()
    assert answer["choices"][0]["message"]["content"] == "Sure: w0 w2"
    assert answer["choices"][0]["token_ids"] == GENERATED
    chunks = _chunks(chat(client, messages=messages, echo=True, add_generation_prompt=False,
                          continue_final_message=True, stream=True, return_token_ids=True))
    role, echoed, *tokens = chunks
    assert role["prompt_token_ids"] == manager.calls[-1].prompt_ids
    assert echoed["choices"][0]["delta"] == {"content": "Sure:"} and "prompt_token_ids" not in echoed
    assert "token_ids" not in echoed["choices"][0]
    assert [token for chunk in tokens for token in chunk["choices"][0]["token_ids"]] == GENERATED


def test_tool_call_stream_ids_add_up_to_every_generated_token() -> None:
    script = ["Sure.", "\n<tool_call>\n", '{"name": "get_weather", ', '"arguments": {"city": "Paris"}}',
              "\n</tool_call>"]
    client, manager = make_client(script)
    whole = chat(client, tools=[WEATHER_TOOL], return_token_ids=True).json()
    generated = list(range(20, 20 + len(script)))
    assert whole["choices"][0]["finish_reason"] == "tool_calls" and whole["choices"][0]["token_ids"] == generated
    assert whole["prompt_token_ids"] == manager.calls[-1].prompt_ids
    chunks = _chunks(chat(client, tools=[WEATHER_TOOL], stream=True, return_token_ids=True))
    choices = [chunk["choices"][0] for chunk in chunks[1:]]
    # Pieces held back while a call block may be starting still send their ids; the finish goes in a
    # chunk of its own after the call, with no token.
    assert [token for choice in choices for token in choice["token_ids"]] == generated
    assert choices[-1]["finish_reason"] == "tool_calls" and choices[-1]["token_ids"] == []
