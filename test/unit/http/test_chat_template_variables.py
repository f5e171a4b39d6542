"""``documents`` and ``chat_template_kwargs`` keys reach the chat template only as its variables: one the
template never reads is refused (400 naming it) rather than accepted and dropped, as ``messages[i].name``.

The rendering half runs the server's own ``encode_chat_messages`` with a real tokenizer; the HTTP half
puts it behind the real app (the fake manager of ``api_fakes`` otherwise renders nothing).
"""

from __future__ import annotations

from typing import Any

import pytest
from fastapi.testclient import TestClient
from transformers import AutoTokenizer

from api_fakes import assert_error, chat
from chat_rendering_support import RenderingManager
from lightllm.server import served_model
from lightllm.server.http.app import create_app
from lightllm.server.http.server_options import HttpServerOptions
from lightllm.server.chat_render_checks import UnreadTemplateFieldError
from lightllm.server.served_model import encode_chat_messages

PLAIN = "{% for m in messages %}{{ m.role }}: {{ m.content }}\n{% endfor %}"
RAG = "{% for d in documents %}[{{ d.title }}] {{ d.text }}\n{% endfor %}" + PLAIN
# Qwen3's test: only false changes the prompt, true is the template's default.
THINKING = PLAIN + "{% if enable_thinking is defined and enable_thinking is false %}<no-think>{% endif %}"
# Reads tools, and a variable set from a kwarg with a default.
TOOLS = ("{% set style = style | default('short') %}{% if tools %}tools: {{ tools | length }}\n{% endif %}"
         "{{ style }}\n" + PLAIN)
DOCS = [{"title": "Paris", "text": "The capital of France."}]
MESSAGES = [{"role": "user", "content": "hi"}]


def _render(tokenizer: Any, template: str, **kwargs: Any) -> str:
    ids = encode_chat_messages(tokenizer, MESSAGES, chat_template_kwargs={"chat_template": template, **kwargs})
    return tokenizer.decode(ids)


def _refused(tokenizer: Any, template: str, **kwargs: Any) -> UnreadTemplateFieldError:
    with pytest.raises(UnreadTemplateFieldError) as refused:
        _render(tokenizer, template, **kwargs)
    return refused.value


def test_documents_the_template_never_reads_are_refused(tokenizer) -> None:
    error = _refused(tokenizer, PLAIN, documents=DOCS)
    assert error.param == "documents" and "does not read documents" in str(error)
    assert _render(tokenizer, RAG, documents=DOCS) == "[Paris] The capital of France.\nuser: hi\n"
    # An empty list under a template that reads documents is honoured too (it reads them: none).
    assert _render(tokenizer, RAG, documents=[]) == "user: hi\n"


def test_template_kwargs_the_template_never_reads_are_refused(tokenizer) -> None:
    error = _refused(tokenizer, THINKING, enable_thinking=False, anything=1)
    assert error.param == "chat_template_kwargs.anything" and "'anything'" in str(error)
    error = _refused(tokenizer, PLAIN, enable_thinking=False)
    assert error.param == "chat_template_kwargs.enable_thinking"


def test_template_kwargs_the_template_reads_work_even_when_the_prompt_is_the_same(tokenizer) -> None:
    # true renders as without it (the template only tests for false), and is still the template's to read.
    assert _render(tokenizer, THINKING, enable_thinking=True) == _render(tokenizer, THINKING) == "user: hi\n"
    assert _render(tokenizer, THINKING, enable_thinking=False) == "user: hi\n<no-think>"
    assert _render(tokenizer, TOOLS, style="long").startswith("long\n")
    assert _render(tokenizer, TOOLS, style="short") == _render(tokenizer, TOOLS)


def test_what_the_renderer_itself_consumes_is_not_refused(tokenizer) -> None:
    # The request's own template and the tools arrive in the same keyword arguments; neither is a
    # variable to check (tools a template does not render are refused by rendering without them:
    # test_chat_tool_rendering).
    tool = {"type": "function", "function": {"name": "f"}}
    assert _render(tokenizer, TOOLS, tools=[tool]).startswith("tools: 1\n")


def test_a_reasoning_effort_the_template_only_mentions_in_a_comment_is_refused(tokenizer) -> None:
    error = _refused(tokenizer, "{# reasoning_effort is not used #}" + PLAIN, reasoning_effort="high")
    assert error.param == "reasoning_effort"
    assert _render(tokenizer, "{{ reasoning_effort }}|" + PLAIN, reasoning_effort="high") == "high|user: hi\n"


def test_the_tokenizer_template_is_the_one_checked(tokenizer_dir) -> None:
    tokenizer = AutoTokenizer.from_pretrained(tokenizer_dir)
    tokenizer.chat_template = {"default": PLAIN, "tool_use": "{{ tools | length }}{{ documents | length }}" + PLAIN}
    with pytest.raises(UnreadTemplateFieldError):
        encode_chat_messages(tokenizer, MESSAGES, chat_template_kwargs={"documents": DOCS})
    # With tools the tool_use template renders, and it reads documents.
    tool = {"type": "function", "function": {"name": "f"}}
    ids = encode_chat_messages(tokenizer, MESSAGES, chat_template_kwargs={"documents": DOCS, "tools": [tool]})
    assert tokenizer.decode(ids) == "11user: hi\n"


class RenderOnlyTokenizer:
    """A tokenizer whose template is Python, not Jinja source: nothing to parse, so renders are compared."""

    chat_template = object()

    def apply_chat_template(self, messages: list[dict[str, Any]], tokenize: bool = False,
                            add_generation_prompt: bool = True, continue_final_message: bool = False,
                            **variables: Any) -> str:
        return f"{variables.get('style', '')}|{messages[-1]['content']}"

    def __call__(self, text: str, add_special_tokens: bool = True, verbose: bool = True) -> dict[str, list[int]]:
        return {"input_ids": [ord(char) for char in text]}


def test_a_template_without_parsable_source_is_checked_by_rendering() -> None:
    tokenizer = RenderOnlyTokenizer()
    assert encode_chat_messages(tokenizer, MESSAGES, chat_template_kwargs={"style": "x"}) == [ord("x"), ord("|"),
                                                                                            ord("h"), ord("i")]
    with pytest.raises(UnreadTemplateFieldError) as refused:
        encode_chat_messages(tokenizer, MESSAGES, chat_template_kwargs={"style": "x", "other": 1})
    assert refused.value.param == "chat_template_kwargs.other"


def test_nothing_is_checked_without_such_variables(tokenizer, monkeypatch) -> None:
    def fail(*args: Any) -> None:
        raise AssertionError("the template was analysed for a chat with nothing to check")

    monkeypatch.setattr(served_model, "template_variables", fail)
    assert _render(tokenizer, PLAIN) == "user: hi\n"


# ---------------------------------------------------------------- through the app


@pytest.fixture()
def rendering_client(tokenizer_dir) -> TestClient:
    tokenizer = AutoTokenizer.from_pretrained(tokenizer_dir)
    tokenizer.chat_template = THINKING
    manager = RenderingManager(tokenizer)
    return TestClient(create_app(manager, HttpServerOptions(trust_request_chat_template=True)),
                      raise_server_exceptions=False)


def test_the_api_refuses_unread_documents_and_template_kwargs(rendering_client: TestClient) -> None:
    client = rendering_client
    error = assert_error(chat(client, documents=DOCS), 400, "documents")
    assert "has no effect" in error["message"]
    error = assert_error(chat(client, chat_template_kwargs={"enable_thinking": False, "anything": 1}), 400,
                         "chat_template_kwargs.anything")
    assert "'anything'" in error["message"]
    for value in (True, False):
        assert chat(client, chat_template_kwargs={"enable_thinking": value}).status_code == 200
    # A request's own template is checked in its place.
    assert chat(client, documents=DOCS, chat_template=RAG).status_code == 200
    assert_error(chat(client, chat_template=PLAIN, chat_template_kwargs={"enable_thinking": False}), 400,
                 "chat_template_kwargs.enable_thinking")
    # reasoning_effort follows the same rule (test_api_client_fields: a template reading it gets it),
    # counting the enable_thinking it sets: THINKING reads that, so it is taken (see the tests below).
    error = assert_error(chat(client, reasoning_effort="low", chat_template=PLAIN), 400, "reasoning_effort")
    assert "reads neither reasoning_effort nor enable_thinking" in error["message"]
    # Tools (tool_choice none: no parser needed) that this template does not render are refused alike.
    tool = {"type": "function", "function": {"name": "f"}}
    assert_error(chat(client, tools=[tool], tool_choice="none"), 400, "tools")


@pytest.mark.parametrize("key", ["sanitize_control_tokens", "padding"])
def test_render_call_arguments_in_template_kwargs_are_refused_naming_them(tokenizer, key: str) -> None:
    # Arguments of apply_chat_template itself (not template variables): the server renders with its
    # own; sanitize_control_tokens (transformers 5.25) failed the render blaming "messages".
    import inspect

    if key not in inspect.signature(type(tokenizer).apply_chat_template).parameters:
        pytest.skip(f"this transformers has no apply_chat_template argument {key}")
    error = _refused(tokenizer, PLAIN, **{key: True})
    assert error.param == f"chat_template_kwargs.{key}"
    assert "argument of transformers' apply_chat_template" in str(error)


# ---------------------------------------------------------------- reasoning_effort sets enable_thinking

# Reads both variables, as the outside tester's template does.
EFFORT_AND_THINKING = ("{% if enable_thinking %}THINK {% endif %}{% if reasoning_effort %}E={{ reasoning_effort }} "
                       "{% endif %}" + PLAIN)
# Reads only enable_thinking (Gemma-style opt-in: no thinking unless asked).
THINKING_ONLY = "{% if enable_thinking %}THINK {% endif %}" + PLAIN


@pytest.fixture()
def effort_manager(tokenizer_dir) -> RenderingManager:
    tokenizer = AutoTokenizer.from_pretrained(tokenizer_dir)
    tokenizer.chat_template = THINKING
    return RenderingManager(tokenizer)


@pytest.fixture()
def effort_client(effort_manager: RenderingManager) -> TestClient:
    return TestClient(create_app(effort_manager, HttpServerOptions(trust_request_chat_template=True)),
                      raise_server_exceptions=False)


def _prompt_text(client: TestClient, manager: RenderingManager, **fields: Any) -> str:
    """The prompt the chat endpoint rendered for ``fields`` (the manager records its ids)."""
    response = chat(client, **fields)
    assert response.status_code == 200, response.text
    return manager.served.chat_tokenizer.decode(manager.calls[-1].prompt_ids)


@pytest.mark.parametrize(("effort", "thinks"), [("none", False), ("minimal", True), ("low", True), ("medium", True),
                                                ("high", True), ("xhigh", True), ("max", True)])
def test_reasoning_effort_also_sets_enable_thinking_as_vllm_does(effort_client: TestClient,
                                                                 effort_manager: RenderingManager, effort: str,
                                                                 thinks: bool) -> None:
    """vLLM 0.32 passes enable_thinking = (reasoning_effort != "none") beside reasoning_effort; only
    reasoning_effort reached the template ("E=high user: hi" where vLLM renders "THINK E=high ..."),
    and xhigh and max (vLLM's values) were refused."""
    text = _prompt_text(effort_client, effort_manager, chat_template=EFFORT_AND_THINKING, reasoning_effort=effort)
    assert text == ("THINK " if thinks else "") + f"E={effort} user: hi\n"


def test_reasoning_effort_works_through_a_template_that_reads_only_enable_thinking(
        effort_client: TestClient, effort_manager: RenderingManager) -> None:
    # It was refused as "not a reasoning model": the check now counts the enable_thinking it sets.
    assert _prompt_text(effort_client, effort_manager, chat_template=THINKING_ONLY, reasoning_effort="low") == \
        "THINK user: hi\n"
    assert _prompt_text(effort_client, effort_manager, chat_template=THINKING_ONLY, reasoning_effort="none") == "user: hi\n"
    # Qwen3's test (only false changes the prompt) reads it too: "none" turns thinking off.
    assert _prompt_text(effort_client, effort_manager, reasoning_effort="none") == "user: hi\n<no-think>"
    # /tokenize renders the chat the same way.
    response = effort_client.post("/tokenize", json={"messages": MESSAGES, "chat_template": THINKING_ONLY,
                                                     "reasoning_effort": "high"})
    assert effort_manager.served.chat_tokenizer.decode(response.json()["tokens"]) == "THINK user: hi\n"


def test_the_clients_enable_thinking_wins_over_the_one_reasoning_effort_sets(
        effort_client: TestClient, effort_manager: RenderingManager) -> None:
    text = _prompt_text(effort_client, effort_manager, chat_template=EFFORT_AND_THINKING, reasoning_effort="high",
                        chat_template_kwargs={"enable_thinking": False})
    assert text == "E=high user: hi\n"
    # Then reasoning_effort reaches the template only as itself: one that does not read it is no use.
    error = assert_error(chat(effort_client, chat_template=THINKING_ONLY, reasoning_effort="high",
                              chat_template_kwargs={"enable_thinking": True}), 400, "reasoning_effort")
    assert "enable_thinking, which reasoning_effort would set, is given in chat_template_kwargs" in error["message"]
    # A template reading neither refuses reasoning_effort, naming both variables.
    error = assert_error(chat(effort_client, chat_template=PLAIN, reasoning_effort="high"), 400, "reasoning_effort")
    assert "reads neither reasoning_effort nor enable_thinking" in error["message"]


class ThinkingRenderOnlyTokenizer(RenderOnlyTokenizer):
    """A Python template (nothing to parse) that reads only enable_thinking."""

    def apply_chat_template(self, messages: list[dict[str, Any]], tokenize: bool = False,
                            add_generation_prompt: bool = True, continue_final_message: bool = False,
                            **variables: Any) -> str:
        return f"{'T' if variables.get('enable_thinking') else ''}|{messages[-1]['content']}"


def test_an_unparsable_template_reading_enable_thinking_takes_reasoning_effort() -> None:
    tokenizer = ThinkingRenderOnlyTokenizer()
    kwargs = {"reasoning_effort": "high", "enable_thinking": True}
    ids = encode_chat_messages(tokenizer, MESSAGES, chat_template_kwargs=kwargs,
                               implied_variables=frozenset({"enable_thinking"}))
    assert ids == [ord(char) for char in "T|hi"]
    # Given by the client, enable_thinking is its own; reasoning_effort then changes nothing.
    with pytest.raises(UnreadTemplateFieldError) as refused:
        encode_chat_messages(tokenizer, MESSAGES, chat_template_kwargs=kwargs)
    assert refused.value.param == "reasoning_effort"
