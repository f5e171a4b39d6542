"""A history's tool calls must reach the prompt: a chat template that does not render them would drop
them without a word, so such a chat is refused (400 naming ``messages.N.tool_calls``), as an unread
message ``name`` is.  So are ``tools`` under tool_choice none, where the prompt is all they act
through; under auto they still decide which calls are read from the output.

The rendering half runs the server's own ``encode_chat_messages`` with a real tokenizer; the HTTP half
puts it behind the real app (the fake manager of ``api_fakes`` renders nothing).
"""

from __future__ import annotations

from typing import Any

import pytest
from fastapi.testclient import TestClient
from transformers import AutoTokenizer

from api_fakes import assert_error, chat
from chat_rendering_support import RenderingManager
from lightllm.server.chat_render_checks import UnreadMessageFieldError, UnreadTemplateFieldError
from lightllm.server.http.app import create_app
from lightllm.server.http.server_options import HttpServerOptions
from lightllm.server import served_model
from lightllm.server.prompt_length_probe import RenderedChatTooLongError
from lightllm.server.served_model import encode_chat_messages

# Prints each message's role and content only (the outside tester's template).
PLAIN = "{% for m in messages %}{{ m.role }}: {{ m.content }}|{% endfor %}"
CALLS = ("{% for m in messages %}{{ m.role }}: {{ m.content }}{% for c in m.tool_calls or [] %} "
         "[{{ c.function.name }}({{ c.function.arguments | tojson }})]{% endfor %}|{% endfor %}")
TOOLS = "{% for t in tools or [] %}tool {{ t.function.name }}|{% endfor %}" + PLAIN
TOOL = {"type": "function", "function": {"name": "clock", "parameters": {"type": "object", "properties": {}}}}
TEMPLATE_CALL = {"id": "c1", "type": "function", "function": {"name": "clock", "arguments": {}}}
HISTORY = [{"role": "user", "content": "time?"}, {"role": "assistant", "content": None, "tool_calls": [TEMPLATE_CALL]},
           {"role": "tool", "content": "12:00", "tool_call_id": "c1"}]
USER = [{"role": "user", "content": "time?"}]


def _text(tokenizer: Any, messages: list[dict[str, Any]], template: str, **options: Any) -> str:
    kwargs = {"chat_template": template, **options.pop("kwargs", {})}
    return tokenizer.decode(encode_chat_messages(tokenizer, messages, chat_template_kwargs=kwargs, **options))


def test_tool_calls_the_template_does_not_render_are_refused(tokenizer) -> None:
    with pytest.raises(UnreadMessageFieldError, match=r"messages\[1\]\.tool_calls has no effect") as refused:
        _text(tokenizer, HISTORY, PLAIN)
    assert refused.value.param == "messages.1.tool_calls"
    assert _text(tokenizer, HISTORY, CALLS) == "user: time?|assistant:  [clock({})]|tool: 12:00|"


def test_tools_the_template_does_not_render_are_refused_when_asked(tokenizer) -> None:
    with pytest.raises(UnreadTemplateFieldError, match="tools have no effect") as refused:
        _text(tokenizer, USER, PLAIN, kwargs={"tools": [TOOL]})
    assert refused.value.param == "tools"
    assert _text(tokenizer, USER, TOOLS, kwargs={"tools": [TOOL]}) == "tool clock|user: time?|"
    # Not asked (tool_choice auto, required, named; /tokenize): rendered without them.
    assert _text(tokenizer, USER, PLAIN, kwargs={"tools": [TOOL]}, check_tools_read=False) == "user: time?|"


def test_an_over_long_chat_is_refused_after_one_render(tokenizer, monkeypatch) -> None:
    """The name, tool-call and tools checks each render the chat again: they ran first, so a chat over
    the character bound was rendered four times before it was refused."""
    renders = []
    real_render = served_model._render_chat
    monkeypatch.setattr(served_model, "_render_chat", lambda *args: renders.append(1) or real_render(*args))
    template = "{% for t in tools or [] %}tool {{ t.function.name }}|{% endfor %}" + CALLS.replace(
        "{{ m.role }}", "{{ m.role }}{{ m.name or '' }}")
    messages = [{**HISTORY[0], "name": "ann"}, *HISTORY[1:]]
    kwargs = {"chat_template": template, "tools": [TOOL]}
    encode_chat_messages(tokenizer, messages, chat_template_kwargs=kwargs, max_chars=10_000)
    assert len(renders) == 4  # the chat, without names, without tool calls, without tools
    renders.clear()
    with pytest.raises(RenderedChatTooLongError):
        encode_chat_messages(tokenizer, messages, chat_template_kwargs=kwargs, max_chars=10)
    assert len(renders) == 1


def test_tools_are_checked_against_the_template_they_select(tokenizer_dir) -> None:
    """With named templates the tools pick tool_use: comparing with a render by default (which differs
    anyway) would pass tools that tool_use drops."""
    tokenizer = AutoTokenizer.from_pretrained(tokenizer_dir)
    tokenizer.chat_template = {"default": "plain " + PLAIN, "tool_use": PLAIN}
    with pytest.raises(UnreadTemplateFieldError, match="tools have no effect"):
        encode_chat_messages(tokenizer, USER, chat_template_kwargs={"tools": [TOOL]})
    tokenizer.chat_template = {"default": PLAIN, "tool_use": TOOLS}
    ids = encode_chat_messages(tokenizer, USER, chat_template_kwargs={"tools": [TOOL]})
    assert tokenizer.decode(ids) == "tool clock|user: time?|"


def test_the_demo_checkpoints_template_renders_tools_and_tool_calls(tiny_llama_dir) -> None:
    tokenizer = AutoTokenizer.from_pretrained(tiny_llama_dir)
    ids = encode_chat_messages(tokenizer, HISTORY, chat_template_kwargs={"tools": [TOOL]})
    text = tokenizer.decode(ids)
    assert '"name": "clock"' in text and '<tool_call>\n{"name": "clock", "arguments": {}}' in text


# ---------------------------------------------------------------- through the app


@pytest.fixture()
def plain_client(tokenizer_dir) -> TestClient:
    tokenizer = AutoTokenizer.from_pretrained(tokenizer_dir)
    tokenizer.chat_template = PLAIN
    options = HttpServerOptions(tool_call_parser="hermes")
    return TestClient(create_app(RenderingManager(tokenizer), options), raise_server_exceptions=False)


def test_the_api_refuses_tools_and_tool_calls_the_template_drops(plain_client: TestClient) -> None:
    client = plain_client
    error = assert_error(chat(client, tools=[TOOL], tool_choice="none"), 400, "tools")
    assert "does not render tools" in error["message"] and "tool_choice 'none'" in error["message"]
    # The tester's request: /tokenize rendered the history without its call.
    body = {"messages": [{"role": "user", "content": "u"}, {"role": "assistant", "content": None, "tool_calls": [
        {"id": "c", "type": "function", "function": {"name": "f", "arguments": "{}"}}]}]}
    error = assert_error(client.post("/tokenize", json=body), 400, "messages.1.tool_calls")
    assert "does not render an assistant turn's tool calls" in error["message"]


def test_tokenize_renders_tools_the_template_drops_without_refusing_them(plain_client: TestClient) -> None:
    """/tokenize has no tool_choice and generates nothing: it gives the ids the chat endpoint renders
    (under auto, say) rather than the 400 it gave, which the chat endpoint gives under none only."""
    with_tools = plain_client.post("/tokenize", json={"messages": USER, "tools": [TOOL]})
    assert with_tools.status_code == 200, with_tools.text
    assert with_tools.json()["tokens"] == plain_client.post("/tokenize", json={"messages": USER}).json()["tokens"]


@pytest.mark.parametrize("choice", [None, "auto", "required", {"type": "function", "function": {"name": "clock"}}])
def test_tools_the_template_drops_are_accepted_where_they_still_act(plain_client: TestClient, choice: Any) -> None:
    """auto reads calls of the tools from the output (a client may describe them in its own system
    message, and vLLM parses such calls); a forced call holds them in its grammar.  auto was refused."""
    fields = {"tools": [TOOL], **({"tool_choice": choice} if choice is not None else {})}
    assert chat(plain_client, **fields).status_code == 200
    assert chat(plain_client, stream=True, **fields).status_code == 200


def test_a_tools_null_fields_render_as_left_out(tokenizer_dir) -> None:
    """OpenAI's SDKs and pydantic dumps send a function's unset fields as null; the docs read null as
    absent on every known field, so the prompt must be the one without them (it held "description":
    null, "parameters": null, "strict": null, tokens that leaving them out does not put there)."""
    tokenizer = AutoTokenizer.from_pretrained(tokenizer_dir)
    tokenizer.chat_template = "{{ tools | tojson }}" + PLAIN
    client = TestClient(create_app(RenderingManager(tokenizer), HttpServerOptions()), raise_server_exceptions=False)
    bare = {"type": "function", "function": {"name": "f"}}
    nulls = {"type": "function", "function": {"name": "f", "description": None, "parameters": None, "strict": None}}
    rendered = []
    for tool in (bare, nulls):
        answer = client.post("/tokenize", json={"messages": USER, "tools": [tool]})
        assert answer.status_code == 200, answer.text
        rendered.append(tokenizer.decode(answer.json()["tokens"]))
    assert rendered[0] == rendered[1] == '[{"type": "function", "function": {"name": "f"}}]user: time?|'
