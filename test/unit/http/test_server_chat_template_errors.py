"""A chat template shipped in the checkpoint that does not compile: warned at start, and every
chat is answered 500 chat_template_invalid (not a 400 that blames the client's messages)."""

from __future__ import annotations

import copy
import logging
from typing import Any

import pytest
from transformers import AutoTokenizer

from lightllm.server.http.errors import manager_error
from lightllm.server.manager_errors import ServerChatTemplateError
from lightllm.server.served_model import ServedModel, check_checkpoint_templates, encode_chat_messages

MESSAGES = [{"role": "user", "content": "hi"}]
UNCLOSED = "{{ bos_token }}{% for m in messages %}{{ m['content'] }}"
UNKNOWN_FILTER = "{% for m in messages %}{{ m['content'] | no_such_filter }}{% endfor %}"
GOOD = "{% for m in messages %}{{ m['content'] }}{% endfor %}"


def _tokenizer(tokenizer_dir: Any, template: Any) -> Any:
    tokenizer = AutoTokenizer.from_pretrained(tokenizer_dir)
    tokenizer.chat_template = copy.deepcopy(template)
    return tokenizer


@pytest.mark.parametrize("template, words", [(UNCLOSED, "Unexpected end of template"),
                                             (UNKNOWN_FILTER, "No filter named 'no_such_filter'")])
def test_the_server_template_is_checked_at_start_and_answered_500(tokenizer_dir: Any, template: str, words: str,
                                                                  caplog: pytest.LogCaptureFixture) -> None:
    tokenizer = _tokenizer(tokenizer_dir, template)
    problem = check_checkpoint_templates(tokenizer)
    assert problem.startswith("the server's chat template is not a valid Jinja template: ") and words in problem
    assert problem.endswith("start the server with --chat_template to replace it")
    with caplog.at_level(logging.WARNING, logger="lightllm.server.served_model"):
        ServedModel("m", ["m"], tokenizer, vocab_size=1000, eos_token_ids=[1], max_req_total_len=64)
    assert [record.getMessage() for record in caplog.records] == [
        f"{problem}; until then every chat request fails with 500 chat_template_invalid"]
    with pytest.raises(ServerChatTemplateError) as err:
        encode_chat_messages(tokenizer, MESSAGES)
    error = manager_error(err.value, "messages")
    assert (error.status_code, error.code, error.param) == (500, "chat_template_invalid", None)
    # A request's own broken template is still the client's 400.
    with pytest.raises(ValueError, match="^chat_template is not a valid Jinja template"):
        encode_chat_messages(_tokenizer(tokenizer_dir, GOOD), MESSAGES, chat_template_kwargs={"chat_template": UNCLOSED})


def test_named_templates_name_the_broken_one_and_good_ones_pass(tokenizer_dir: Any) -> None:
    assert check_checkpoint_templates(_tokenizer(tokenizer_dir, GOOD)) is None
    assert check_checkpoint_templates(_tokenizer(tokenizer_dir, None)) is None
    named = {"default": GOOD, "tool_use": UNCLOSED}
    assert check_checkpoint_templates(_tokenizer(tokenizer_dir, named)).startswith(
        "the server's chat template 'tool_use' is not a valid Jinja template")


def test_chat_template_flag_replaces_a_broken_checkpoint_template_without_a_warning(
        tokenizer_dir: Any, caplog: pytest.LogCaptureFixture) -> None:
    from lightllm.server.request_defaults import RequestDefaults

    tokenizer = _tokenizer(tokenizer_dir, UNCLOSED)
    with caplog.at_level(logging.WARNING, logger="lightllm.server.served_model"):
        served = ServedModel("m", ["m"], tokenizer, vocab_size=1000, eos_token_ids=[1], max_req_total_len=64,
                             request_defaults=RequestDefaults(chat_template=GOOD))
    assert not [record for record in caplog.records if "chat template" in record.getMessage()]
    assert tokenizer.decode(served.encode_chat(MESSAGES)) == "hi"


def test_named_templates_without_a_default_are_the_servers_problem_not_the_clients(
        tokenizer_dir: Any, caplog: pytest.LogCaptureFixture) -> None:
    # Not caught at start, and every chat without tools got a 400 telling the client to pass a
    # template, which a client may not do without --trust_request_chat_template.
    TOOLS = "{% for t in tools %}{{ t['name'] }} {% endfor %}{% for m in messages %}{{ m['content'] }}{% endfor %}"
    for named, with_tools in (({"rag": GOOD, "tool_use": TOOLS}, True), ({"rag": GOOD}, False)):
        tokenizer = _tokenizer(tokenizer_dir, named)
        problem = check_checkpoint_templates(tokenizer)
        assert problem.startswith("the server's chat templates are named 'rag'") and "none of them 'default'" in problem
        caplog.clear()
        with caplog.at_level(logging.WARNING, logger="lightllm.server.served_model"):
            ServedModel("m", ["m"], tokenizer, vocab_size=1000, eos_token_ids=[1], max_req_total_len=64)
        which = "every chat without tools" if with_tools else "every chat request"
        assert f"{problem}; until then {which} fails with 500 chat_template_invalid" in caplog.text
        with pytest.raises(ServerChatTemplateError) as err:
            encode_chat_messages(tokenizer, MESSAGES)
        error = manager_error(err.value, "messages")
        assert (error.status_code, error.code) == (500, "chat_template_invalid")
        tools = {"tools": [{"name": "f"}]}
        if with_tools:  # transformers picks tool_use for a chat with tools
            assert tokenizer.decode(encode_chat_messages(tokenizer, MESSAGES, chat_template_kwargs=tools)) == "f hi"
        else:
            with pytest.raises(ServerChatTemplateError):
                encode_chat_messages(tokenizer, MESSAGES, chat_template_kwargs=tools)
        # A request naming one of them (a server that trusts request templates) is served.
        assert tokenizer.decode(encode_chat_messages(tokenizer, MESSAGES, chat_template_kwargs={"chat_template": "rag"})) == "hi"
