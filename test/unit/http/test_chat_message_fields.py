"""Chat messages as clients send them back: OpenAI's assistant fields, tool results as parts, names.

The rendering half runs the server's own ``encode_chat_messages`` with a real tokenizer and
templates given per request, so each case names the template behaviour it depends on.
"""

from __future__ import annotations

from typing import Any

import pytest
from fastapi.testclient import TestClient
from openai.types.chat import ParsedChatCompletionMessage, ParsedFunctionToolCall
from openai.types.chat.parsed_function_tool_call import ParsedFunction

from api_fakes import assert_error, chat
from lightllm.server.chat_render_checks import UnreadMessageFieldError
from lightllm.server.served_model import encode_chat_messages

CALL = {"id": "c1", "type": "function", "function": {"name": "clock", "arguments": "{}"}}


def _dumped_assistant(**fields: Any) -> dict[str, Any]:
    """An assistant message as the openai client's ``message.model_dump()`` writes it."""
    return {"content": None, "refusal": None, "role": "assistant", "annotations": None, "audio": None,
            "function_call": None, "tool_calls": [CALL], **fields}


def test_a_dumped_response_message_is_taken_as_history(client: TestClient, manager) -> None:
    messages = [{"role": "user", "content": "time?"}, _dumped_assistant(),
                {"role": "tool", "tool_call_id": "c1", "content": "12:00"}]
    assert chat(client, messages=messages).status_code == 200
    assert "refusal" not in manager.served.chat_messages[-1][1] and manager.served.chat_messages[-1][1]["tool_calls"]


def test_a_message_of_the_sdks_parse_helpers_is_taken_as_history(client: TestClient, manager) -> None:
    """client.chat.completions.parse() and .stream() return ParsedChatCompletionMessage, whose dump adds
    ``parsed`` (the content parsed into the response_format's model) and each call's
    ``parsed_arguments``: repeats of what the template renders, accepted and not used (both were 400s)."""
    answer = ParsedChatCompletionMessage(role="assistant", content='{"a": 1}', parsed={"a": 1})
    calls = ParsedChatCompletionMessage(role="assistant", content=None, parsed=None, tool_calls=[
        ParsedFunctionToolCall(id="c1", type="function",
                               function=ParsedFunction(name="clock", arguments="{}", parsed_arguments={}))])
    messages = [{"role": "user", "content": "x"}, answer.model_dump(), {"role": "user", "content": "time?"},
                calls.model_dump(), {"role": "tool", "tool_call_id": "c1", "content": "12:00"}]
    assert chat(client, messages=messages).status_code == 200
    rendered = manager.served.chat_messages[-1]
    assert rendered[1] == {"role": "assistant", "content": '{"a": 1}'}
    assert rendered[3]["tool_calls"] == [{"id": "c1", "type": "function", "function": {"name": "clock",
                                                                                       "arguments": {}}}]


def test_parsed_beside_content_given_as_parts_is_accepted(client: TestClient, manager) -> None:
    parts = {"role": "assistant", "content": [{"type": "text", "text": '{"a": 1}'}], "parsed": {"a": 1}}
    assert chat(client, messages=[{"role": "user", "content": "x"}, parts, {"role": "user", "content": "y"}]).status_code == 200
    assert manager.served.chat_messages[-1][1] == {"role": "assistant", "content": '{"a": 1}'}


@pytest.mark.parametrize(("message", "says"), [
    ({"role": "user", "content": "x", "parsed": {"a": 1}}, "parsed belongs to assistant messages"),
    (_dumped_assistant(tool_calls=None, parsed={"a": 1}), "send the turn's text as content"),
])
def test_parsed_without_the_content_it_repeats_is_refused(client: TestClient, message: dict[str, Any],
                                                          says: str) -> None:
    error = assert_error(chat(client, messages=[{"role": "user", "content": "x"}, message]), 400, "messages.1.parsed")
    assert says in error["message"]


def test_a_refusal_is_the_assistant_turn(client: TestClient, manager) -> None:
    messages = [{"role": "user", "content": "x"}, _dumped_assistant(refusal="I can't", tool_calls=None),
                {"role": "user", "content": "ok"}]
    assert chat(client, messages=messages).status_code == 200
    assert manager.served.chat_messages[-1][1]["content"] == "I can't"


@pytest.mark.parametrize(("message", "field"), [
    (_dumped_assistant(audio={"id": "a1"}), "audio"),
    (_dumped_assistant(function_call={"name": "clock", "arguments": "{}"}), "function_call"),
    (_dumped_assistant(annotations=[{"type": "url_citation"}]), "annotations"),
    # The refusal's own checks name the field, not the whole message (they read role and content).
    (_dumped_assistant(refusal="no", content="yes", tool_calls=None), "refusal"),
    ({"role": "user", "content": "x", "refusal": "no"}, "refusal"),
])
def test_assistant_fields_with_values_are_refused(client: TestClient, message: dict[str, Any], field: str) -> None:
    error = assert_error(chat(client, messages=[{"role": "user", "content": "x"}, message]), 400, f"messages.1.{field}")
    assert error["message"].startswith(f"Invalid value for 'messages.1.{field}': ") and field in error["message"]


@pytest.mark.parametrize("field", ["refusal", "reasoning_content", "reasoning"])
@pytest.mark.parametrize("path", ["/v1/chat/completions", "/tokenize"])
def test_an_assistant_field_on_a_user_message_is_named_by_the_refusal(client: TestClient, path: str,
                                                                     field: str) -> None:
    """The refusal named the message (``messages.0``), not the field the client has to remove."""
    body: dict[str, Any] = {"messages": [{"role": "user", "content": "hi", field: "x"}]}
    if path != "/tokenize":
        body["max_tokens"] = 1
    error = assert_error(client.post(path, json=body), 400, f"messages.0.{field}")
    assert error["message"] == (f"Invalid value for 'messages.0.{field}': {field} belongs to assistant messages, "
                                "not to a 'user' message")


# ---------------------------------------------------------------- rendering

# Loops over content parts for users only, as many templates do; prints a tool result as it is.
PARTS_FOR_USERS = ("{% for m in messages %}{{ m.role }}:"
                   "{% if m.role == 'user' and m.content is not string %}{% for p in m.content %}{{ p.text }}"
                   "{% endfor %}{% else %}{{ m.content }}{% endif %}|{% endfor %}")


def _text(tokenizer, messages: list[dict[str, Any]], template: str) -> str:
    ids = encode_chat_messages(tokenizer, messages, chat_template_kwargs={"chat_template": template})
    return tokenizer.decode(ids)


def test_a_tool_result_sent_as_parts_reaches_the_prompt_as_text(tokenizer) -> None:
    asked = [{"type": "text", "text": "time"}, {"type": "text", "text": "?"}]
    result = [{"type": "text", "text": "12"}, {"type": "text", "text": "00"}]
    text = _text(tokenizer, [{"role": "user", "content": asked}, {"role": "tool", "content": result}],
                 PARTS_FOR_USERS)
    assert text == "user:time?|tool:12\n00|"


def test_a_name_the_template_ignores_is_refused(tokenizer) -> None:
    messages = [{"role": "user", "content": "hi"}, {"role": "user", "content": "yo", "name": "bob"}]
    with pytest.raises(UnreadMessageFieldError, match=r"messages\[1\]\.name has no effect") as refused:
        _text(tokenizer, messages, "{% for m in messages %}{{ m.content }}{% endfor %}")
    assert refused.value.param == "messages.1.name"
    reads_names = "{% for m in messages %}{{ m.name or m.role }}: {{ m.content }}\n{% endfor %}"
    assert _text(tokenizer, messages, reads_names) == "user: hi\nbob: yo\n"


def test_a_name_dropped_for_its_role_is_refused_though_another_role_reads_names(tokenizer) -> None:
    """A template that prints names of tool messages only: the tool's name hid the user's, which was
    dropped without a word."""
    tool_names = ("{% for m in messages %}{{ m.role }}{% if m.role == 'tool' %} {{ m.name }}{% endif %}: "
                  "{{ m.content }}\n{% endfor %}")
    messages = [{"role": "user", "content": "hi", "name": "alice"}, {"role": "tool", "content": "12", "name": "clock"}]
    with pytest.raises(UnreadMessageFieldError, match=r"messages\[0\]\.name has no effect.*a user message") as refused:
        _text(tokenizer, messages, tool_names)
    assert refused.value.param == "messages.0.name"
    assert _text(tokenizer, [{"role": "user", "content": "hi"}, messages[1]], tool_names) == "user: hi\ntool clock: 12\n"


QWEN3_LIKE = ("{% for m in messages %}<|{{ m.role }}|>{% if m.role == 'assistant' and m.reasoning_content %}"
              "<think>{{ m.reasoning_content }}</think>{% endif %}{{ m.content }}{% endfor %}")


@pytest.mark.parametrize("field", ["reasoning_content", "reasoning"])
def test_an_assistant_turns_reasoning_reaches_a_template_that_reads_it(manager, field: str) -> None:
    """Agent loops replaying a reasoning model's turns send it back (vLLM returns it and hands it on);
    it was refused as an unknown field."""
    from lightllm.server.http.app import create_app
    from lightllm.server.http.server_options import HttpServerOptions

    trusting = TestClient(create_app(manager, HttpServerOptions(trust_request_chat_template=True)))
    messages = [{"role": "user", "content": "2+2?"}, {"role": "assistant", "content": "4", field: "add them"},
                {"role": "user", "content": "and 3+3?"}]
    assert chat(trusting, messages=messages, chat_template=QWEN3_LIKE).status_code == 200
    sent = manager.served.chat_messages[-1][1]
    assert sent["reasoning_content"] == sent["reasoning"] == "add them"
    # A template that never mentions reasoning would drop it: refused, naming the field.
    error = assert_error(chat(trusting, messages=messages, chat_template="{% for m in messages %}{{ m.content }}"
                              "{% endfor %}"), 400, f"messages.1.{field}")
    assert "does not read an assistant turn's reasoning" in error["message"]
    error = assert_error(chat(trusting, messages=[{"role": "user", "content": "x", field: "y"}]), 400,
                         f"messages.0.{field}")
    assert error["message"] == (f"Invalid value for 'messages.0.{field}': {field} belongs to assistant messages, "
                                "not to a 'user' message")
    # Two names of one field with two texts: the later name is the one refused.
    both = {"role": "assistant", "content": "4", "reasoning_content": "a", "reasoning": "b"}
    assert_error(chat(trusting, messages=[{"role": "user", "content": "x"}, both]), 400, "messages.1.reasoning")


def test_a_rendered_chat_over_the_character_limit_is_refused_before_it_is_tokenized(tokenizer) -> None:
    """/tokenize's character bound was passed as a token limit: 200,000 empty messages rendered 5.6 M
    characters, whose 1.2 M tokens were under it (14 s and 1.4 GB of the HTTP process)."""
    from lightllm.server.prompt_length_probe import RenderedChatTooLongError

    template = "{% for m in messages %}<{{ m.role }}>{{ m.content }}{% endfor %}"
    messages = [{"role": "user", "content": ""}] * 100  # 600 characters rendered, no text of their own
    ids = encode_chat_messages(tokenizer, messages, chat_template_kwargs={"chat_template": template}, max_chars=600)
    assert tokenizer.decode(ids) == "<user>" * 100
    with pytest.raises(RenderedChatTooLongError) as refused:
        encode_chat_messages(tokenizer, messages, chat_template_kwargs={"chat_template": template}, max_chars=599)
    assert (refused.value.limit, refused.value.chars) == (599, 600)
