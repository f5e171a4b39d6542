"""vLLM's ``echo`` on ``/v1/chat/completions``: the last message's content before the answer's when
that message is the assistant's (the answer's role here), in full responses and streams.

The app is the real ``create_app`` over the scripted manager of ``api_fakes`` (each choice generates
``" w0"``, ``""``, ``" w2"``); a real server is checked in test/integration/api_compat/test_vllm_request_fields.py.
"""

from __future__ import annotations

import asyncio
from typing import Any, AsyncIterator

import pytest
from fastapi.testclient import TestClient

from api_fakes import FakeEvent, FakeManager, assert_error, chat, sse_events
from lightllm.server.http.app import create_app
from lightllm.server.http.server_options import HttpServerOptions

GENERATED = " w0 w2"
PREFILL = [{"role": "user", "content": "Say it"}, {"role": "assistant", "content": "Sure:"}]


def test_echo_prepends_a_last_assistant_message(client: TestClient, manager: FakeManager) -> None:
    response = chat(client, messages=PREFILL, echo=True, n=2, continue_final_message=True,
                    add_generation_prompt=False)
    assert response.status_code == 200, response.text
    body = response.json()
    assert [choice["message"]["content"] for choice in body["choices"]] == ["Sure:" + GENERATED] * 2
    assert all(choice["message"]["role"] == "assistant" for choice in body["choices"])
    # The echoed text is not generated: usage and logprobs cover the generated tokens only.
    assert body["usage"]["completion_tokens"] == 6
    plain = chat(client, messages=PREFILL, n=2, continue_final_message=True, add_generation_prompt=False).json()
    assert [choice["message"]["content"] for choice in plain["choices"]] == [GENERATED] * 2
    assert plain["usage"] == body["usage"]


def test_echo_with_a_generation_prompt_after_an_assistant_message(client: TestClient) -> None:
    response = chat(client, messages=PREFILL, echo=True, logprobs=True)
    choice = response.json()["choices"][0]
    assert choice["message"]["content"] == "Sure:" + GENERATED
    assert len(choice["logprobs"]["content"]) == 3


def test_echo_of_content_parts_joins_them_with_newlines(client: TestClient) -> None:
    messages = [PREFILL[0], {"role": "assistant", "content": [{"type": "text", "text": "a"},
                                                              {"type": "text", "text": "b"}]}]
    response = chat(client, messages=messages, echo=True)
    assert response.json()["choices"][0]["message"]["content"] == "a\nb" + GENERATED


def test_echo_after_a_user_message_adds_nothing(client: TestClient) -> None:
    response = chat(client, echo=True)
    assert response.json()["choices"][0]["message"]["content"] == GENERATED
    events = sse_events(chat(client, echo=True, stream=True))
    # Nothing to echo: no echo chunk, as vLLM sends none for empty text.
    assert [event["choices"][0]["delta"] for event in events[:2]] == [{"role": "assistant", "content": ""},
                                                                        {"content": " w0"}]


def test_echo_streams_the_text_right_after_the_role_chunks(client: TestClient) -> None:
    events = sse_events(chat(client, messages=PREFILL, echo=True, n=2, stream=True,
                             stream_options={"include_usage": True}))
    assert events[-1] == "[DONE]"
    chunks = [event for event in events[:-1] if event["choices"]]
    deltas = [(chunk["choices"][0]["index"], chunk["choices"][0]["delta"]) for chunk in chunks]
    assert deltas[:4] == [(0, {"role": "assistant", "content": ""}), (1, {"role": "assistant", "content": ""}),
                          (0, {"content": "Sure:"}), (1, {"content": "Sure:"})]
    assert chunks[2]["choices"][0]["logprobs"] is None and chunks[2]["choices"][0]["finish_reason"] is None
    for index in (0, 1):
        text = "".join(delta.get("content", "") for choice, delta in deltas if choice == index)
        assert text == "Sure:" + GENERATED
    assert events[-2]["usage"]["completion_tokens"] == 6


def test_echo_false_changes_nothing(client: TestClient) -> None:
    response = chat(client, messages=PREFILL, echo=False)
    assert response.json()["choices"][0]["message"]["content"] == GENERATED


def test_echo_refused_where_vllm_would_answer_in_another_role(client: TestClient) -> None:
    error = assert_error(chat(client, echo=True, add_generation_prompt=False), 400, "echo")
    assert "'user'" in error["message"]
    # Without echo the request is served as before.
    assert chat(client, add_generation_prompt=False).status_code == 200


@pytest.mark.parametrize("value", ["yes", 1])
def test_echo_must_be_a_boolean(client: TestClient, value: Any) -> None:
    error = assert_error(chat(client, echo=value), 400, "echo")
    assert "Unknown parameter" not in error["message"]


def test_chat_echo_does_not_allow_max_tokens_zero(client: TestClient) -> None:
    error = assert_error(chat(client, messages=PREFILL, echo=True, max_tokens=0), 400, "max_tokens")
    assert "echo" not in error["message"]


class CallingManager(FakeManager):
    """Every generation writes one hermes tool call and nothing else."""

    async def generate(self, spec: Any, *, request: Any = None) -> AsyncIterator[FakeEvent]:
        pieces = ['<tool_call>{"name": "clock", ', '"arguments": {}}</tool_call>']
        for position, piece in enumerate(pieces):
            await asyncio.sleep(0)
            finish = "stop" if position == len(pieces) - 1 else None
            yield FakeEvent(1, 20 + position, piece, -0.5, finish, len(spec.prompt_ids), 0, position + 1, None)


def test_echo_with_tool_calls_reads_calls_from_the_generated_text_only() -> None:
    manager = CallingManager()
    client = TestClient(create_app(manager, HttpServerOptions(tool_call_parser="hermes")),
                        raise_server_exceptions=False)
    tools = [{"type": "function", "function": {"name": "clock"}}]
    messages = [PREFILL[0], {"role": "assistant", "content": "Let me check."}]
    choice = chat(client, messages=messages, tools=tools, echo=True).json()["choices"][0]
    assert [call["function"]["name"] for call in choice["message"]["tool_calls"]] == ["clock"]
    # vLLM: content is the echoed text plus the content beside the calls (none here).
    assert choice["message"]["content"] == "Let me check."
    assert choice["finish_reason"] == "tool_calls"
    without = chat(client, messages=messages, tools=tools).json()["choices"][0]
    assert without["message"]["content"] is None
