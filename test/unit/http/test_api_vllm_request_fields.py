"""vLLM request fields on the OpenAI endpoints: ``add_special_tokens``, ``response_format`` on completions,
``spaces_between_special_tokens`` (true only) and the 400 of the vLLM fields that stay unsupported.

The app is the real ``create_app`` over the scripted manager of ``api_fakes``; the same fields on a
real server are checked in test/integration/api_compat/test_vllm_request_fields.py.
"""

from __future__ import annotations

from typing import Any

import pytest
from fastapi.testclient import TestClient

from api_fakes import BOS, FakeManager, assert_error, chat, completion
from lightllm.server.http.app import create_app


class BosTokenizer:
    """The fake word tokenizer as a callable tokenizer: with special tokens it puts BOS first (as Llama's)."""

    all_special_ids = [0, BOS, 2]

    def __init__(self, manager: FakeManager) -> None:
        self._manager = manager

    def __call__(self, text: str, add_special_tokens: bool = True) -> dict[str, list[int]]:
        return {"input_ids": FakeManager.encode_prompt(self._manager, text, add_special_tokens)}

    def decode(self, ids: list[int]) -> str:
        return "".join(f"<{token_id}>" for token_id in ids)


@pytest.fixture()
def bos_manager() -> FakeManager:
    manager = FakeManager()
    manager.tokenizer = BosTokenizer(manager)
    return manager


@pytest.fixture()
def bos_client(bos_manager: FakeManager) -> TestClient:
    return TestClient(create_app(bos_manager), raise_server_exceptions=False)


# ---------------------------------------------------------------- add_special_tokens


def test_completions_add_special_tokens_switches_the_bos(client: TestClient, manager: FakeManager) -> None:
    default = completion(client, prompt="hello there")
    explicit = completion(client, prompt="hello there", add_special_tokens=True)
    without = completion(client, prompt="hello there", add_special_tokens=False)
    assert [response.status_code for response in (default, explicit, without)] == [200, 200, 200]
    with_bos = manager.encode_prompt("hello there")
    assert [call.prompt_ids for call in manager.calls] == [with_bos, with_bos, with_bos[1:]]
    # usage.prompt_tokens counts what was sent to the model.
    assert default.json()["usage"]["prompt_tokens"] == len(with_bos)
    assert without.json()["usage"]["prompt_tokens"] == len(with_bos) - 1


def test_completions_add_special_tokens_leaves_token_ids_alone(client: TestClient, manager: FakeManager) -> None:
    for value in (True, False):
        assert completion(client, prompt=[[5, 6, 7], [BOS, 8]], add_special_tokens=value).status_code == 200
    assert [call.prompt_ids for call in manager.calls] == [[5, 6, 7], [BOS, 8]] * 2


def test_chat_add_special_tokens_adds_the_tokenizers_on_top(bos_client: TestClient, bos_manager: FakeManager) -> None:
    default = chat(bos_client)
    explicit = chat(bos_client, add_special_tokens=False)
    added = chat(bos_client, add_special_tokens=True)
    assert [response.status_code for response in (default, explicit, added)] == [200, 200, 200]
    rendered = bos_manager.encode_chat([{"role": "user", "content": "hi"}])
    # The default is what the server always did (the rendered chat as the manager tokenized it);
    # true adds the tokenizer's BOS on top, as vLLM does even when the template wrote one.
    assert [call.prompt_ids for call in bos_manager.calls] == [rendered, rendered, [BOS, *rendered]]
    assert added.json()["usage"]["prompt_tokens"] == default.json()["usage"]["prompt_tokens"] + 1


def test_chat_add_special_tokens_counts_before_truncation(bos_client: TestClient, bos_manager: FakeManager) -> None:
    # The prompt the model reads is cut to its last k tokens after the special tokens were added.
    assert chat(bos_client, add_special_tokens=True, truncate_prompt_tokens=2).status_code == 200
    assert len(bos_manager.calls[0].prompt_ids) == 2


@pytest.mark.parametrize("send", [completion, chat])
@pytest.mark.parametrize("value", ["yes", 1, [True]])
def test_add_special_tokens_must_be_a_boolean(client: TestClient, send: Any, value: Any) -> None:
    error = assert_error(send(client, add_special_tokens=value), 400, "add_special_tokens")
    assert "Unknown parameter" not in error["message"]


# ---------------------------------------------------------------- response_format on completions


@pytest.mark.parametrize(("response_format", "constrained"), [
    ({"type": "text"}, False),
    ({"type": "json_object"}, True),
    ({"type": "json_schema", "json_schema": {"name": "point", "schema": {
        "type": "object", "properties": {"x": {"type": "integer"}}, "required": ["x"]}}}, True),
])
def test_completions_take_response_format(client: TestClient, manager: FakeManager, response_format: dict[str, Any],
                                          constrained: bool) -> None:
    assert completion(client, response_format=response_format).status_code == 200
    assert (manager.calls[0].params.grammar is not None) is constrained


def test_completions_response_format_grammar_is_chats(client: TestClient, manager: FakeManager) -> None:
    schema = {"type": "json_schema", "json_schema": {"name": "s", "schema": {"type": "array"}}}
    assert completion(client, response_format=schema).status_code == 200
    assert chat(client, response_format=schema).status_code == 200
    assert manager.calls[0].params.grammar == manager.calls[1].params.grammar


@pytest.mark.parametrize(("response_format", "param"), [
    ({"type": "xml"}, "response_format"),
    ({"type": "json_schema"}, "response_format"),
    ({"type": "json_schema", "json_schema": {"name": "bad name", "schema": {}}}, "response_format.json_schema.name"),
    ({"type": "json_schema", "json_schema": {"name": "s", "schema": {"type": "nonsense"}}},
     "response_format.json_schema.schema"),
    ("json_object", "response_format"),
])
def test_completions_refuse_a_bad_response_format(client: TestClient, response_format: Any, param: str) -> None:
    error = assert_error(completion(client, response_format=response_format), 400, param)
    assert "Unknown parameter" not in error["message"]


@pytest.mark.parametrize("other", [{"guided_regex": "[a-z]+"}, {"structured_outputs": {"choice": ["a", "b"]}},
                                   {"guided_json": {"type": "object"}}])
def test_completions_response_format_is_the_only_constraint(client: TestClient, other: dict[str, Any]) -> None:
    error = assert_error(completion(client, response_format={"type": "json_object"}, **other), 400,
                         "response_format")
    assert "one way only" in error["message"]


def test_completions_response_format_refuses_ignore_eos(client: TestClient) -> None:
    assert_error(completion(client, response_format={"type": "json_object"}, ignore_eos=True), 400, "ignore_eos")


# ---------------------------------------------------------------- spaces_between_special_tokens


@pytest.mark.parametrize("send", [completion, chat])
def test_spaces_between_special_tokens_true_is_accepted(client: TestClient, send: Any) -> None:
    assert send(client, spaces_between_special_tokens=True).status_code == 200
    assert send(client, spaces_between_special_tokens=True, skip_special_tokens=False).status_code == 200


@pytest.mark.parametrize("send", [completion, chat])
def test_spaces_between_special_tokens_false_is_refused_with_the_reason(client: TestClient, send: Any) -> None:
    error = assert_error(send(client, spaces_between_special_tokens=False, skip_special_tokens=False), 400,
                         "spaces_between_special_tokens")
    assert "not supported" in error["message"] and "fast tokenizer" in error["message"]
    assert_error(send(client, spaces_between_special_tokens="no"), 400, "spaces_between_special_tokens")


def test_fast_tokenizers_ignore_spaces_between_special_tokens(tokenizer: Any) -> None:
    """Why false is refused: the fast tokenizer decodes the same text whatever the flag says."""
    ids = tokenizer("the fox")["input_ids"] + [tokenizer.eos_token_id, tokenizer.bos_token_id, tokenizer.eos_token_id]
    assert tokenizer.is_fast
    spaced = tokenizer.decode(ids, skip_special_tokens=False, spaces_between_special_tokens=True)
    assert spaced == tokenizer.decode(ids, skip_special_tokens=False, spaces_between_special_tokens=False)
    assert spaced == tokenizer.backend_tokenizer.decode(ids, skip_special_tokens=False)
    assert "</s><s></s>" in spaced


# ---------------------------------------------------------------- still refused


@pytest.mark.parametrize("send", [completion, chat])
@pytest.mark.parametrize(("name", "value"), [("allowed_token_ids", [5, 6]), ("bad_words", ["foo"]),
                                             ("allowed_token_ids", None), ("bad_words", [])])
def test_unimplemented_vllm_fields_say_they_are_not_supported(client: TestClient, send: Any, name: str,
                                                              value: Any) -> None:
    error = assert_error(send(client, **{name: value}), 400, name)
    assert error["message"].startswith(f"'{name}' is not supported by this server")


def test_other_unknown_fields_are_still_unknown(client: TestClient) -> None:
    error = assert_error(completion(client, allowed_tokens=[5]), 400, "allowed_tokens")
    assert error["message"].startswith("Unknown parameter 'allowed_tokens'")


class TextDependentTokenizer(BosTokenizer):
    """Adds a token that depends on the text: its special tokens cannot be added to a rendered chat."""

    def __call__(self, text: str, add_special_tokens: bool = True) -> dict[str, list[int]]:
        ids = FakeManager.encode_prompt(self._manager, text, False)
        return {"input_ids": ids + [len(ids)] * add_special_tokens}


def test_chat_add_special_tokens_refused_when_the_tokenizer_has_no_fixed_frame(bos_manager: FakeManager) -> None:
    bos_manager.tokenizer = TextDependentTokenizer(bos_manager)
    client = TestClient(create_app(bos_manager), raise_server_exceptions=False)
    error = assert_error(chat(client, add_special_tokens=True), 400, "add_special_tokens")
    assert "depend on the text" in error["message"]
    assert chat(client).status_code == 200
