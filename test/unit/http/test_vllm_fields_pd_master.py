"""The PD master serves the vLLM request fields as a normal server does: it runs the same HTTP code
over its own manager (``build_master``), so the refusals and the prompt tokenization must match.

No node joins: every request here is answered (or tokenized) before one would be needed.
"""

from __future__ import annotations

import asyncio
from pathlib import Path
from typing import Any

import pytest
from fastapi.testclient import TestClient

from lightllm.server.http.app import create_app
from lightllm.server.http.generation.prompt_encoding import PromptEncoder

from pd_master_support import master_manager

MESSAGES = [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Sure:"}]


@pytest.fixture(scope="module")
def pd_manager(tiny_llama_dir: Path) -> Any:
    return master_manager(tiny_llama_dir)


@pytest.mark.parametrize(("path", "fields", "param", "words"), [
    ("/v1/completions", {"spaces_between_special_tokens": False}, "spaces_between_special_tokens", "not supported"),
    ("/v1/chat/completions", {"spaces_between_special_tokens": False}, "spaces_between_special_tokens",
     "not supported"),
    ("/v1/completions", {"allowed_token_ids": [1]}, "allowed_token_ids", "not supported"),
    ("/v1/chat/completions", {"bad_words": ["x"]}, "bad_words", "not supported"),
    ("/v1/completions", {"response_format": {"type": "json_object"}, "guided_regex": "a+"}, "response_format",
     "one way only"),
    ("/v1/completions", {"response_format": {"type": "yaml"}}, "response_format", "response_format"),
    ("/v1/chat/completions", {"echo": True, "add_generation_prompt": False,
                              "messages": [{"role": "user", "content": "Hi"}]}, "echo", "'user'"),
    ("/v1/completions", {"add_special_tokens": "no"}, "add_special_tokens", "add_special_tokens"),
])
def test_pd_master_refuses_as_a_server_does(pd_manager: Any, path: str, fields: dict[str, Any], param: str,
                                            words: str) -> None:
    client = TestClient(create_app(pd_manager), raise_server_exceptions=False)
    body = {"prompt": "hello", "messages": MESSAGES, **fields}
    body.pop("messages" if path == "/v1/completions" else "prompt")
    response = client.post(path, json=body)
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert error["param"] == param and words in error["message"]


def test_pd_master_tokenizes_with_and_without_special_tokens(pd_manager: Any) -> None:
    tokenizer = pd_manager.served.tokenizer
    encoder = PromptEncoder(pd_manager)
    prompt = asyncio.run(encoder.encode_prompt("hello world", "prompt"))
    bare = asyncio.run(encoder.encode_prompt("hello world", "prompt", add_special_tokens=False))
    assert prompt == tokenizer("hello world")["input_ids"] and bare == prompt[1:]
    rendered = asyncio.run(encoder.encode_chat(MESSAGES, "messages"))
    added = asyncio.run(encoder.encode_chat(MESSAGES, "messages", add_special_tokens=True))
    text = tokenizer.apply_chat_template(MESSAGES, tokenize=False, add_generation_prompt=True)
    assert rendered == tokenizer(text, add_special_tokens=False)["input_ids"]
    assert added == tokenizer(text, add_special_tokens=True)["input_ids"] == [tokenizer.bos_token_id, *rendered]
