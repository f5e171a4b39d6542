"""What a request inherits when it leaves a field out, through the real app: the checkpoint's sampling
defaults (``--generation_config``), LightLLM's greedy ``/generate``, the chat content form the template
wants, a hermes tool parser's special tokens, and prompts holding tokens the model cannot read."""

from __future__ import annotations

from typing import Any

import pytest
from fastapi.testclient import TestClient

from api_fakes import FakeManager, assert_error, chat, completion
from lightllm.common.basemodel.generation_defaults import GenerationDefaults
from lightllm.server.http.app import create_app
from lightllm.server.http.openai.chat_content_format import rendering_template, template_iterates_content
from lightllm.server.http.server_options import HttpServerOptions
from lightllm.server.served_model import default_max_new_tokens

CHECKPOINT = GenerationDefaults(temperature=0.25, top_p=0.8, top_k=5, min_p=0.05, repetition_penalty=1.5,
                                presence_penalty=1.25, frequency_penalty=-0.5, max_new_tokens=7, do_sample=True,
                                source="generation_config.json")


def _native(client: TestClient, **parameters: Any) -> Any:
    return client.post("/generate", json={"inputs": "hello there", "parameters": parameters})


@pytest.fixture()
def checkpoint_client(manager: FakeManager) -> TestClient:
    manager.served.generation_defaults = CHECKPOINT
    return TestClient(create_app(manager), raise_server_exceptions=False)


@pytest.mark.parametrize("send", [completion, chat])
def test_openai_requests_inherit_the_fields_they_leave_out(checkpoint_client: TestClient, manager: FakeManager,
                                                          send: Any) -> None:
    assert send(checkpoint_client).status_code == 200
    params = manager.calls[-1].params
    assert (params.temperature, params.top_p, params.top_k, params.min_p, params.repetition_penalty) == (
        0.25, 0.8, 5, 0.05, 1.5)
    # vLLM applies the file's presence_penalty and frequency_penalty too; they were dropped.
    assert (params.presence_penalty, params.frequency_penalty) == (1.25, -0.5)
    assert send(checkpoint_client, presence_penalty=0, frequency_penalty=0.5).status_code == 200
    assert (manager.calls[-1].params.presence_penalty, manager.calls[-1].params.frequency_penalty) == (0, 0.5)
    # do_sample is /generate's switch; an OpenAI request samples by its temperature alone (vLLM).
    assert params.do_sample is None
    assert send(checkpoint_client, temperature=0, top_k=-1).status_code == 200
    params = manager.calls[-1].params
    assert (params.temperature, params.top_k, params.top_p) == (0, -1, 0.8)


def test_without_a_checkpoint_value_the_server_defaults_hold(client: TestClient, manager: FakeManager) -> None:
    assert completion(client).status_code == 200
    params = manager.calls[-1].params
    assert (params.temperature, params.top_p, params.top_k, params.min_p, params.repetition_penalty,
            params.presence_penalty, params.frequency_penalty) == (1.0, 1.0, -1, 0.0, 1.0, 0.0, 0.0)
    assert _native(client).status_code == 200
    assert (manager.calls[-1].params.presence_penalty, manager.calls[-1].params.frequency_penalty) == (0.0, 0.0)


def test_native_generate_is_greedy_unless_asked_to_sample(client: TestClient, manager: FakeManager) -> None:
    assert _native(client).status_code == 200
    assert manager.calls[-1].params.is_greedy
    # A sampling field is never silently ignored: giving one that changes the distribution samples
    # (TGI's rule); a neutral value (no filter, no scaling) asks for nothing and stays greedy.
    for field, value in (("temperature", 0.7), ("top_p", 0.9), ("top_k", 3), ("min_p", 0.2)):
        assert _native(client, **{field: value}).status_code == 200
        assert manager.calls[-1].params.do_sample is True and not manager.calls[-1].params.is_greedy, field
    for field, value in (("temperature", 1.0), ("top_p", 1.0), ("top_k", -1), ("top_k", 0), ("min_p", 0.0)):
        assert _native(client, **{field: value}).status_code == 200
        assert manager.calls[-1].params.is_greedy, (field, value)
    assert _native(client, min_p=0.3, do_sample=True).status_code == 200
    assert manager.calls[-1].params.min_p == 0.3
    assert _native(client, temperature=0.7, do_sample=False).status_code == 200
    assert manager.calls[-1].params.is_greedy
    assert _native(client, do_sample=True).status_code == 200
    assert not manager.calls[-1].params.is_greedy and manager.calls[-1].params.temperature == 1.0


def test_native_generate_follows_the_checkpoint(checkpoint_client: TestClient, manager: FakeManager) -> None:
    assert _native(checkpoint_client).status_code == 200
    params = manager.calls[-1].params
    assert params.do_sample is True and (params.temperature, params.top_k, params.repetition_penalty) == (0.25, 5, 1.5)
    assert (params.presence_penalty, params.frequency_penalty) == (1.25, -0.5)
    assert _native(checkpoint_client, presence_penalty=0.0, frequency_penalty=2).status_code == 200
    assert (manager.calls[-1].params.presence_penalty, manager.calls[-1].params.frequency_penalty) == (0.0, 2)
    assert _native(checkpoint_client, temperature=0.9, do_sample=False).status_code == 200
    assert manager.calls[-1].params.is_greedy and manager.calls[-1].params.temperature == 0.9
    manager.served.generation_defaults = GenerationDefaults(temperature=0.6, do_sample=False)
    assert _native(checkpoint_client).status_code == 200
    assert manager.calls[-1].params.is_greedy
    # The checkpoint's min_p is inherited as on the OpenAI endpoints, and a request can turn it off.
    manager.served.generation_defaults = GenerationDefaults(min_p=0.99, do_sample=True)
    assert _native(checkpoint_client).status_code == 200
    assert manager.calls[-1].params.min_p == 0.99
    assert _native(checkpoint_client, min_p=0).status_code == 200
    assert manager.calls[-1].params.min_p == 0


def test_the_completion_length_default_order() -> None:
    # --max_new_tokens_default, then the checkpoint's max_new_tokens, then the endpoint's, capped by the context.
    assert default_max_new_tokens(100, 10, configured=5, fallback=16, checkpoint=7) == 5
    assert default_max_new_tokens(100, 10, configured=None, fallback=16, checkpoint=7) == 7
    assert default_max_new_tokens(100, 10, configured=None, fallback=16, checkpoint=None) == 16
    assert default_max_new_tokens(100, 10, configured=None, fallback=None, checkpoint=None) == 90
    assert default_max_new_tokens(100, 95, configured=None, fallback=None, checkpoint=70) == 5


# ---------------------------------------------------------------- chat content parts

PARTS_TEMPLATE = ("{% for m in messages %}{% if m['content'] is string %}{{ m['content'] }}{% else %}"
                  "{% for p in m['content'] %}{{ p['text'] }}{% endfor %}{% endif %}{% endfor %}")
STRING_TEMPLATE = "{% for m in messages %}{{ m.role }}: {{ m.content }}\n{% endfor %}"


def test_which_templates_iterate_over_content() -> None:
    assert template_iterates_content(PARTS_TEMPLATE)
    assert template_iterates_content("{% for m in messages %}{% for p in m.content %}{{ p.text }}{% endfor %}{% endfor %}")
    assert template_iterates_content("{% for m in messages %}{% set c = m['content'] %}{% for p in c %}{{ p.text }}"
                                     "{% endfor %}{% endfor %}")
    assert template_iterates_content("{% for m in messages %}{% for p in m.content | selectattr('type', "
                                     "'equalto', 'text') %}{{ p.text }}{% endfor %}{% endfor %}")
    assert not template_iterates_content("{% for m in messages %}{% set c = m.role %}{% for x in c %}{{ x }}"
                                         "{% endfor %}{% endfor %}")
    assert not template_iterates_content(STRING_TEMPLATE)
    assert not template_iterates_content("{% for m in messages %")
    assert rendering_template({"default": "A", "tool_use": "B"}, None, with_tools=True) == "B"
    assert rendering_template({"default": "A", "tool_use": "B"}, None, with_tools=False) == "A"
    assert rendering_template([{"name": "default", "template": "A"}], None, with_tools=True) == "A"
    assert rendering_template("A", "C", with_tools=False) == "C"


@pytest.mark.parametrize("template, expected", [
    (PARTS_TEMPLATE, [{"type": "text", "text": "Hello"}, {"type": "text", "text": "world"}]),
    (STRING_TEMPLATE, "Hello\nworld"),
])
def test_content_parts_reach_the_template_in_the_form_it_reads(client: TestClient, manager: FakeManager,
                                                               template: str, expected: Any) -> None:
    manager.served.tokenizer.chat_template = template
    parts = [{"type": "text", "text": "Hello"}, {"type": "text", "text": "world"}]
    manager.served.encode_chat = lambda messages, **options: (manager.served.chat_messages.append(messages), [1, 2])[1]
    assert chat(client, messages=[{"role": "user", "content": parts}]).status_code == 200
    assert manager.served.chat_messages[-1][0]["content"] == expected


@pytest.mark.parametrize("part, named", [
    ({"type": "text", "text": "x", "cache_control": {"type": "ephemeral"}}, "'cache_control'"),
    ({"type": "text"}, "needs 'text' as a string, got none"),
    ({"type": "text", "text": 3}, "needs 'text' as a string, got int"),
    ({"type": "image_url", "image_url": {"url": "x"}}, "type 'image_url'"),
])
def test_a_content_part_the_server_cannot_take_is_refused_naming_what(client: TestClient, part: Any,
                                                                       named: str) -> None:
    answer = chat(client, messages=[{"role": "user", "content": [{"type": "text", "text": "a"}, part]}])
    assert answer.status_code == 400, answer.text
    error = answer.json()["error"]
    assert error["param"] == "messages.0.content" and "content part 1" in error["message"]
    assert named in error["message"], error["message"]


# ---------------------------------------------------------------- tool parsers that read special tokens

TOOL = {"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}


@pytest.mark.parametrize("parser, tool_choice, keeps", [
    ("hermes", None, True), ("hermes", "none", False), ("llama3_json", None, False), ("hermes", "required", False)])
def test_a_hermes_parser_sees_special_tokens(manager: FakeManager, parser: str, tool_choice: str | None,
                                             keeps: bool) -> None:
    client = TestClient(create_app(manager, HttpServerOptions(tool_call_parser=parser)), raise_server_exceptions=False)
    fields = {"tools": [TOOL]} if tool_choice is None else {"tools": [TOOL], "tool_choice": tool_choice}
    assert chat(client, **fields).status_code == 200
    assert manager.calls[-1].params.skip_special_tokens is (not keeps)


# ---------------------------------------------------------------- tokens beyond the model's vocabulary


def test_a_prompt_the_tokenizer_maps_beyond_the_vocabulary_names_the_field(client: TestClient,
                                                                           manager: FakeManager) -> None:
    manager.served.vocab_size = 50  # "zzzzz" is token 60 to the fake tokenizer
    error = assert_error(completion(client, prompt="zzzzz"), 400, "prompt")
    assert "beyond the model's vocabulary [0, 50)" in error["message"]
    assert_error(chat(client, messages=[{"role": "user", "content": "zzzzz"}]), 400, "messages")
    assert_error(client.post("/generate", json={"inputs": "zzzzz"}), 400, "inputs")
    assert not manager.calls
