"""The chat prompt's character bound counts the message texts, as docs/EN/limits_and_auth.md says.

Before, it counted every string of the messages (roles, part types, names, tool-call ids) and
said "the messages has N characters".
"""

from __future__ import annotations

import re

from fastapi.testclient import TestClient

from api_fakes import MODEL, FakeManager, assert_error
from lightllm.server.http.app import create_app
from lightllm.server.http.generation.prompt_encoding import text_chars
from lightllm.server.http.server_options import HttpLimits, HttpServerOptions

# FakeManager: max_req_total_len 64; 2 characters per token: at most 128 characters of text.
BOUND = 128


def _client() -> TestClient:
    return TestClient(create_app(FakeManager(), HttpServerOptions(limits=HttpLimits(prompt_chars_per_token=2))))


def _chat(messages: list) -> dict:
    return {"model": MODEL, "messages": messages, "max_tokens": 1}


def test_only_the_message_texts_are_counted() -> None:
    messages = [{"role": "system", "content": "s" * 10},
                {"role": "user", "content": [{"type": "text", "text": "a" * 5}, {"type": "text", "text": "b" * 7}]},
                {"role": "assistant", "content": None, "tool_calls": [{"id": "call_1", "type": "function",
                                                                        "function": {"name": "f", "arguments": {}}}]},
                {"role": "tool", "content": "r" * 3, "tool_call_id": "call_1", "name": "f"}]
    assert text_chars(messages) == 10 + 5 + 7 + 3


def test_a_chat_whose_texts_fit_is_not_refused_for_its_roles() -> None:
    # 128 characters of text exactly, plus "user"/"assistant" roles: within the bound.
    messages = [{"role": "user", "content": "a" * 64}, {"role": "assistant", "content": "b" * 32},
                {"role": "user", "content": [{"type": "text", "text": "c" * 32}]}]
    reply = _client().post("/v1/chat/completions", json=_chat(messages))
    assert reply.status_code != 400 or reply.json()["error"]["code"] != "context_length_exceeded", reply.text


def test_the_refusal_names_the_message_texts_in_correct_grammar() -> None:
    messages = [{"role": "user", "content": "a" * 100}, {"role": "user", "content": [{"type": "text", "text": "b" * 29}]}]
    error = assert_error(_client().post("/v1/chat/completions", json=_chat(messages)), 400, "messages",
                         "context_length_exceeded")
    assert re.search(rf"and the message texts have 129 characters: more than {BOUND} characters", error["message"]), \
        error["message"]
    assert "messages has" not in error["message"]
    # The prompt keeps its own wording.
    error = assert_error(_client().post("/v1/completions", json={"model": MODEL, "prompt": "p" * 129}), 400, "prompt")
    assert "and the prompt has 129 characters" in error["message"]
