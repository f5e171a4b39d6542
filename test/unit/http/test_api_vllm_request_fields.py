"""vLLM request fields on the OpenAI endpoints: ``add_special_tokens``, ``response_format`` on completions,
``spaces_between_special_tokens`` (true only) and the 400 of the vLLM fields that stay unsupported.

The app is the real ``create_app`` over the scripted manager of ``api_fakes``; the same fields on a
real server are checked in test/integration/api_compat/test_vllm_request_fields.py.
"""

from __future__ import annotations

from typing import Any

import pytest
from fastapi.testclient import TestClient

from api_fakes import BOS, FakeManager, FakeServed, assert_error, chat, completion
from lightllm.server.http.app import create_app


class BosTokenizer:
    """The fake word tokenizer as a callable tokenizer: with special tokens it puts BOS first (as Llama's)."""

    all_special_ids = [0, BOS, 2]

    def __init__(self, served: FakeServed) -> None:
        self._served = served

    def __call__(self, text: str, add_special_tokens: bool = True, verbose: bool = True) -> dict[str, list[int]]:
        return {"input_ids": FakeServed.encode_prompt(self._served, text, add_special_tokens)}

    def decode(self, ids: list[int]) -> str:
        return "".join(f"<{token_id}>" for token_id in ids)


@pytest.fixture()
def bos_manager() -> FakeManager:
    manager = FakeManager()
    manager.served.tokenizer = BosTokenizer(manager.served)
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
    with_bos = manager.served.encode_prompt("hello there")
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
    rendered = bos_manager.served.encode_chat([{"role": "user", "content": "hi"}])
    # The default is what the server always did (the rendered chat as the manager tokenized it);
    # true adds the tokenizer's BOS on top, as vLLM does even when the template wrote one.
    assert [call.prompt_ids for call in bos_manager.calls] == [rendered, rendered, [BOS, *rendered]]
    assert added.json()["usage"]["prompt_tokens"] == default.json()["usage"]["prompt_tokens"] + 1


def test_chat_add_special_tokens_counts_before_truncation(bos_client: TestClient, bos_manager: FakeManager) -> None:
    # The prompt the model reads is its last k tokens, the added BOS kept among them (vLLM truncates
    # in the tokenizer, which adds its special tokens after cutting the text).
    long_chat = [{"role": "user", "content": "one two three four five"}]
    assert chat(bos_client, messages=long_chat, add_special_tokens=True, truncate_prompt_tokens=2).status_code == 200
    rendered = bos_manager.served.encode_chat(long_chat)
    assert bos_manager.calls[0].prompt_ids == [BOS, rendered[-1]]
    # Without added special tokens the chat is simply cut to its end.
    assert chat(bos_client, messages=long_chat, truncate_prompt_tokens=2).status_code == 200
    assert bos_manager.calls[1].prompt_ids == rendered[-2:]


@pytest.mark.parametrize("keep", [1, 3])
def test_a_truncated_text_prompt_keeps_the_bos_the_tokenizer_added(bos_client: TestClient, bos_manager: FakeManager,
                                                                  keep: int) -> None:
    prompt = "one two three four five six"
    with_bos = bos_manager.served.encode_prompt(prompt)
    assert with_bos[0] == BOS
    response = completion(bos_client, prompt=prompt, truncate_prompt_tokens=keep)
    assert response.status_code == 200, response.text
    assert bos_manager.calls[0].prompt_ids == [BOS, *with_bos[len(with_bos) - (keep - 1):]]
    assert response.json()["usage"]["prompt_tokens"] == keep
    # Left out by add_special_tokens false, or given as token ids: the last k tokens as they are.
    assert completion(bos_client, prompt=prompt, truncate_prompt_tokens=keep, add_special_tokens=False).status_code \
        == 200
    assert bos_manager.calls[1].prompt_ids == with_bos[1:][-keep:]
    assert completion(bos_client, prompt=[with_bos], truncate_prompt_tokens=keep).status_code == 200
    assert bos_manager.calls[2].prompt_ids == with_bos[-keep:]


def test_truncate_prompt_tokens_beyond_the_context_is_refused_by_name(client: TestClient, manager: FakeManager) -> None:
    # The fake serves a 64-token context: a prompt cut to 64 leaves no room, whatever it holds.
    too_long = [5 + i % 90 for i in range(100)]
    for send in (lambda **kw: completion(client, prompt=[too_long], **kw),
                 lambda **kw: chat(client, messages=[{"role": "user", "content": "hi"}], **kw)):
        for keep in (65, 300):
            error = assert_error(send(truncate_prompt_tokens=keep), 400, "truncate_prompt_tokens")
            assert f"({keep})" in error["message"] and "64 tokens" in error["message"]
    assert not manager.calls
    # The context length itself is taken, as vLLM takes it: a short prompt is not cut at all.
    assert completion(client, prompt=[too_long[:5]], truncate_prompt_tokens=64, max_tokens=1).status_code == 200
    manager.calls.clear()
    assert completion(client, prompt=[too_long], truncate_prompt_tokens=63, max_tokens=1).status_code == 200
    assert manager.calls[0].prompt_ids == too_long[-63:]


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
    ({"type": "json_schema"}, "response_format.json_schema"),
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


# ---------------------------------------------------------------- vLLM's defaults accepted, other values refused

# Every field vLLM 0.34's request models give a non-None default (entrypoints/openai/*/protocol.py, written
# out by hand): what a client built on them sends with model_dump(exclude_none=True).  request_id's default
# is a fresh uuid4 hex.
VLLM_SHARED_DEFAULTS = dict(
    n=1, stop=[], stream=False, use_beam_search=False, length_penalty=1.0, stop_token_ids=[],
    include_stop_str_in_output=False, ignore_eos=False, min_tokens=0, spaces_between_special_tokens=True, bad_words=[],
    echo=False, priority=0, request_id="0123456789abcdef0123456789abcdef", return_weight_versions=False,
    routed_experts_prompt_start=0, return_token_offsets=False, mm_payload="tensors")
VLLM_CHAT_DEFAULTS = dict(
    VLLM_SHARED_DEFAULTS, logprobs=False, top_logprobs=0, tool_choice="none", include_reasoning=True,
    parallel_tool_calls=True, add_generation_prompt=True, continue_final_message=False, add_special_tokens=False)
VLLM_COMPLETION_DEFAULTS = dict(VLLM_SHARED_DEFAULTS, max_tokens=16, add_special_tokens=True)


def test_a_body_of_every_vllm_default_is_accepted(client: TestClient, manager: FakeManager) -> None:
    response = chat(client, **VLLM_CHAT_DEFAULTS)
    assert response.status_code == 200, response.text
    assert response.json()["choices"][0]["logprobs"] is None
    response = completion(client, **VLLM_COMPLETION_DEFAULTS)
    assert response.status_code == 200, response.text
    assert manager.calls[-1].params.max_new_tokens == 16


@pytest.mark.parametrize("send", [completion, chat])
@pytest.mark.parametrize(("name", "value"), [("bad_words", []), ("bad_words", None), ("allowed_token_ids", None),
                                             ("return_weight_versions", False), ("routed_experts_prompt_start", 0),
                                             ("routed_experts_prompt_start", 0.0), ("return_token_offsets", False),
                                             ("return_token_offsets", None), ("mm_payload", "tensors")])
def test_vllm_fields_at_their_default_are_accepted(client: TestClient, send: Any, name: str, value: Any) -> None:
    assert send(client, **{name: value}).status_code == 200


@pytest.mark.parametrize("send", [completion, chat])
@pytest.mark.parametrize(("name", "value", "why"), [
    ("allowed_token_ids", [5, 6], "not supported"), ("allowed_token_ids", [], "not supported"),
    ("bad_words", ["foo"], "not supported"), ("return_weight_versions", True, "weight versions"),
    ("routed_experts_prompt_start", 3, "routed-expert"), ("return_token_offsets", True, "render endpoints"),
    ("mm_payload", "none", "render endpoints")])
def test_vllm_fields_at_other_values_say_why_they_are_refused(client: TestClient, manager: FakeManager, send: Any,
                                                              name: str, value: Any, why: str) -> None:
    error = assert_error(send(client, **{name: value}), 400, name)
    assert why in error["message"], error
    if name != "allowed_token_ids":
        assert "vLLM's default" in error["message"]
    assert manager.calls == []


@pytest.mark.parametrize("send", [completion, chat])
@pytest.mark.parametrize(("name", "value", "kind"), [
    ("use_beam_search", 0, "boolean"), ("use_beam_search", "false", "boolean"), ("length_penalty", "1", "number"),
    ("length_penalty", True, "number"), ("priority", False, "integer"), ("priority", 0.5, "integer"),
    ("priority", "0", "integer"), ("bad_words", "foo", "list"), ("bad_words", [1], "string"),
    ("allowed_token_ids", "5", "list"), ("allowed_token_ids", [True], "integer"),
    ("return_weight_versions", 0, "boolean"), ("routed_experts_prompt_start", False, "integer"),
    ("return_token_offsets", "no", "boolean"), ("mm_payload", 1, "string")])
def test_vllm_fields_of_another_type_are_type_errors(client: TestClient, manager: FakeManager, send: Any, name: str,
                                                     value: Any, kind: str) -> None:
    """A value of the wrong JSON type reads as the type error every other field gives (use_beam_search: 0
    read "only false, vLLM's default, is accepted: beam search is not supported")."""
    error = assert_error(send(client, **{name: value}), 400, name)
    assert f"Input should be a valid {kind}" in error["message"], error
    assert "not supported" not in error["message"] and "vLLM's default" not in error["message"], error
    assert manager.calls == []


@pytest.mark.parametrize(("send", "fields"), [
    (completion, {}), (completion, {"logprobs": None}), (completion, {"prompt_logprobs": 1}),
    (completion, {"echo": True}), (chat, {}), (chat, {"logprobs": False}), (chat, {"prompt_logprobs": 1}),
    (chat, {"logprobs": None, "top_logprobs": 0})])
def test_return_tokens_as_token_ids_without_logprobs_is_refused(client: TestClient, manager: FakeManager, send: Any,
                                                                fields: dict[str, Any]) -> None:
    """It only names the tokens of logprobs (prompt_logprobs keep their strings, as in vLLM): asked
    without logprobs it was accepted and did nothing."""
    error = assert_error(send(client, return_tokens_as_token_ids=True, **fields), 400, "return_tokens_as_token_ids")
    assert "logprobs" in error["message"] and "asks for no logprobs" in error["message"]
    assert manager.calls == []


def test_return_tokens_as_token_ids_with_logprobs_names_tokens(client: TestClient) -> None:
    choice = completion(client, logprobs=0, return_tokens_as_token_ids=True).json()["choices"][0]
    assert all(token.startswith("token_id:") for token in choice["logprobs"]["tokens"])
    choice = chat(client, logprobs=True, return_tokens_as_token_ids=True).json()["choices"][0]
    assert all(entry["token"].startswith("token_id:") for entry in choice["logprobs"]["content"])
    # false asks for nothing, with or without logprobs.
    assert completion(client, return_tokens_as_token_ids=False).status_code == 200
    assert chat(client, return_tokens_as_token_ids=False).status_code == 200


def test_include_reasoning_true_only(client: TestClient) -> None:
    assert chat(client, include_reasoning=True).status_code == 200
    assert chat(client, include_reasoning=None).status_code == 200
    error = assert_error(chat(client, include_reasoning=False), 400, "include_reasoning")
    assert "no reasoning parser" in error["message"]
    # Another type is a type error (it read as "leaving reasoning out is not supported").
    error = assert_error(chat(client, include_reasoning=1), 400, "include_reasoning")
    assert "Input should be a valid boolean" in error["message"] and "reasoning parser" not in error["message"]
    # A chat field: completions do not know it.
    assert_error(completion(client, include_reasoning=True), 400, "include_reasoning")


def test_top_logprobs_zero_needs_no_logprobs(client: TestClient) -> None:
    """vLLM refuses only top_logprobs > 0 without logprobs; 0 is its default, sent by its clients."""
    for fields in ({"top_logprobs": 0}, {"top_logprobs": 0, "logprobs": False}, {"top_logprobs": 0.0}):
        response = chat(client, **fields)
        assert response.status_code == 200, response.text
        assert response.json()["choices"][0]["logprobs"] is None
    assert_error(chat(client, top_logprobs=1), 400, "top_logprobs")
    assert_error(chat(client, top_logprobs=2, logprobs=False), 400, "top_logprobs")
    done = chat(client, top_logprobs=0, logprobs=True).json()["choices"][0]["logprobs"]["content"]
    assert done and all(entry["top_logprobs"] == [] for entry in done)


def test_other_unknown_fields_are_still_unknown(client: TestClient) -> None:
    error = assert_error(completion(client, allowed_tokens=[5]), 400, "allowed_tokens")
    assert error["message"].startswith("Unknown parameter 'allowed_tokens'")


class TextDependentTokenizer(BosTokenizer):
    """Adds a token that depends on the text: its special tokens cannot be added to a rendered chat."""

    def __call__(self, text: str, add_special_tokens: bool = True, verbose: bool = True) -> dict[str, list[int]]:
        ids = FakeServed.encode_prompt(self._served, text, False)
        return {"input_ids": ids + [len(ids)] * add_special_tokens}


def test_chat_add_special_tokens_refused_when_the_tokenizer_has_no_fixed_frame(bos_manager: FakeManager) -> None:
    bos_manager.served.tokenizer = TextDependentTokenizer(bos_manager.served)
    client = TestClient(create_app(bos_manager), raise_server_exceptions=False)
    error = assert_error(chat(client, add_special_tokens=True), 400, "add_special_tokens")
    assert "depend on the text" in error["message"]
    assert chat(client).status_code == 200
