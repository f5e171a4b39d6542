"""Client-compatibility fields of the OpenAI endpoints.

Null as absent, OpenAI platform fields (accepted with a meaning or refused with the reason),
vLLM's structured-output parameters, ``logit_bias``, ``truncate_prompt_tokens``, chat-template
overrides (the OpenAPI document's agreement with them: test_openapi_agreement.py).
The app is the real ``create_app`` over the scripted manager of ``api_fakes``; the same fields on
a real server are tested in test/integration/api_compat/test_client_fields.py.
"""

from __future__ import annotations

import json
from typing import Any

import pytest
from fastapi.testclient import TestClient

from api_fakes import FakeManager, assert_error, chat, completion
from lightllm.server.http.app import create_app
from lightllm.server.http.openai.chat_completion_request import ChatCompletionRequest
from lightllm.server.http.openai.openai_models import CompletionRequest
from lightllm.server.http.server_options import HttpServerOptions


def _optional_fields(model: Any) -> list[str]:
    return [name for name, info in model.model_fields.items() if not info.is_required()]


# ---------------------------------------------------------------- null means absent


@pytest.mark.parametrize("name", _optional_fields(CompletionRequest))
def test_completions_take_null_for_every_optional_field(client: TestClient, name: str) -> None:
    assert completion(client, **{name: None}).status_code == 200, name


@pytest.mark.parametrize("name", _optional_fields(ChatCompletionRequest))
def test_chat_takes_null_for_every_optional_field(client: TestClient, name: str) -> None:
    assert chat(client, **{name: None}).status_code == 200, name


def test_null_inside_stream_options_is_absent(client: TestClient) -> None:
    response = chat(client, stream=True, stream_options={"include_usage": None, "continuous_usage_stats": None})
    assert response.status_code == 200


# ---------------------------------------------------------------- platform fields


@pytest.mark.parametrize(("fields", "param"), [
    ({"store": True}, "store"),
    ({"service_tier": "flex"}, "service_tier"),
    ({"service_tier": "priority"}, "service_tier"),
    ({"metadata": {f"k{i}": "v" for i in range(17)}}, "metadata"),
    ({"metadata": {"k": "v" * 513}}, "metadata"),
    ({"metadata": {"k": 5}}, "metadata.k"),
    ({"prediction": {"type": "text", "content": "x"}}, "prediction.type"),
    ({"reasoning_effort": "extreme"}, "reasoning_effort"),
    ({"documents": [{"title": 5}]}, "documents.0.title"),
    ({"chat_template": ""}, "chat_template"),
    ({"safety_identifier": "x" * 65}, "safety_identifier"),
    ({"stream": True, "stream_options": {"include_obfuscation": True}}, "stream_options.include_obfuscation"),
])
def test_platform_fields_refused_with_reason(client: TestClient, fields: dict[str, Any], param: str) -> None:
    error = assert_error(chat(client, **fields), 400, param)
    if param == "store":
        assert "stores no completions" in error["message"]
    if param == "service_tier":
        assert "one tier" in error["message"]


@pytest.mark.parametrize(("field", "value", "words"), [
    ("prompt_cache_retention", "24h", "how long OpenAI keeps cached prefixes"),
    ("prompt_cache_options", {}, "cache breakpoints"),
    ("verbosity", "low", "chat_template_kwargs"),
    ("moderation", {}, "runs none"),
])
def test_platform_fields_without_a_meaning_here_say_why(client: TestClient, field: str, value: Any,
                                                        words: str) -> None:
    """api_compatibility.md's platform table gives each refused chat field its reason; so does the 400."""
    error = assert_error(chat(client, **{field: value}), 400, field)
    assert error["message"].startswith(f"'{field}' is not supported: ") and words in error["message"]
    # Legacy completions has none of them in OpenAI's API: there they are unknown fields.
    plain = assert_error(completion(client, **{field: value}), 400, field)
    assert plain["message"] == f"Unknown parameter '{field}'; it is not accepted by this endpoint"
    # Nested, the name means nothing special: the plain unknown-key refusal.
    nested = assert_error(chat(client, stream=True, stream_options={field: value}), 400, f"stream_options.{field}")
    assert "Unknown parameter" in nested["message"]


def test_platform_fields_accepted_with_their_meaning(client: TestClient, manager: FakeManager) -> None:
    accepted = {"store": False, "service_tier": "auto", "metadata": {"team": "a"}, "user": "u1",
                "prediction": {"type": "content", "content": "expected text"}, "safety_identifier": "h-1",
                "prompt_cache_key": "tenant-7"}
    assert chat(client, **accepted).status_code == 200
    assert completion(client, **{**accepted, "service_tier": "default"}).status_code == 200
    assert chat(client, stream=True, stream_options={"include_obfuscation": False}).status_code == 200


@pytest.mark.parametrize("stream", [False, True])
def test_responses_carry_their_id_as_the_request_id_header(client: TestClient, stream: bool) -> None:
    """The openai SDKs read ``x-request-id`` into ``request_id``."""
    for response in (chat(client, stream=stream), completion(client, stream=stream)):
        assert response.status_code == 200
        body = response.json() if not stream else json.loads(response.text.split("data: ", 2)[1].split("\n")[0])
        assert response.headers["x-request-id"] == body["id"]


def test_model_cards_say_when_serving_started_and_a_trailing_slash_is_no_model(client: TestClient) -> None:
    cards = client.get("/v1/models").json()["data"]
    assert cards[0]["created"] > 1_700_000_000 and cards[0]["permission"][0]["created"] == cards[0]["created"]
    assert_error(client.get("/v1/models/"), 404, None, "not_found")


@pytest.fixture()
def trusting_client(manager: FakeManager) -> TestClient:
    """An app started with --trust_request_chat_template."""
    return TestClient(create_app(manager, HttpServerOptions(trust_request_chat_template=True)),
                      raise_server_exceptions=False)


def test_a_request_template_is_refused_unless_the_server_trusts_it(client: TestClient, manager: FakeManager) -> None:
    refused = chat(client, chat_template="{% for m in messages %}{{ m.content }}{% endfor %}")
    assert_error(refused, 400, "chat_template")
    assert "--trust_request_chat_template" in refused.json()["error"]["message"]
    assert not manager.calls
    # Without a template of its own the same request runs.
    assert chat(client).status_code == 200


def test_chat_template_and_documents_reach_the_template(trusting_client: TestClient, manager: FakeManager) -> None:
    client = trusting_client
    docs = [{"title": "a", "text": "b"}]
    assert chat(client, chat_template="{{ messages }}", documents=docs,
                chat_template_kwargs={"flag": True}).status_code == 200
    assert manager.served.template_options["chat_template_kwargs"] == {"flag": True, "chat_template": "{{ messages }}",
                                                                "documents": docs}
    assert_error(chat(client, chat_template_kwargs={"chat_template": "x"}), 400, "chat_template_kwargs")


def test_reasoning_effort_reaches_a_template_that_reads_it(trusting_client: TestClient, manager: FakeManager) -> None:
    client = trusting_client
    template = "{{ reasoning_effort }}{% for m in messages %}{{ m.content }}{% endfor %}"
    assert chat(client, chat_template=template, reasoning_effort="high").status_code == 200
    assert manager.served.template_options["chat_template_kwargs"]["reasoning_effort"] == "high"


def test_the_developer_role_reaches_a_template_that_names_it(trusting_client: TestClient,
                                                             manager: FakeManager) -> None:
    messages = [{"role": "developer", "content": "be brief"}, {"role": "user", "content": "go"}]
    names_it = ("{% for m in messages %}{% if m.role == 'developer' %}D:{% endif %}{{ m.content }}{% endfor %}")
    assert chat(trusting_client, messages=messages, chat_template=names_it).status_code == 200
    assert manager.served.chat_messages[-1][0] == {"role": "developer", "content": "be brief"}
    # A template that knows only "system" gets it as system, as before.
    plain = "{% for m in messages %}{{ m.role }}{{ m.content }}{% endfor %}"
    assert chat(trusting_client, messages=messages, chat_template=plain).status_code == 200
    assert manager.served.chat_messages[-1][0] == {"role": "system", "content": "be brief"}


# ---------------------------------------------------------------- logit_bias, logprobs, truncation


@pytest.mark.parametrize("key", ["0005", "+5", " 5", "5 ", "05"])
def test_logit_bias_keys_are_read_as_python_int_reads_them(client: TestClient, manager: FakeManager, key: str) -> None:
    """vLLM reads keys with int(): "0005", "+5" and " 5" are token 5 (they were refused as not decimal)."""
    assert completion(client, logit_bias={key: -3}).status_code == 200
    assert manager.calls[-1].params.logit_bias == {5: -3.0}


def test_two_logit_bias_keys_naming_one_token_are_refused(client: TestClient) -> None:
    # vLLM keeps the last one; one of the two biases would be dropped without a word.
    error = assert_error(chat(client, logit_bias={"5": 1, "05": -1}), 400, "logit_bias")
    assert "'5' and '05' both name token 5" in error["message"]
    error = assert_error(chat(client, logit_bias={"5e0": 1}), 400, "logit_bias")
    assert "must be token ids (integers" in error["message"]


def test_logit_bias_reaches_the_sampling_params(client: TestClient, manager: FakeManager) -> None:
    assert completion(client, logit_bias={"5": 2, "7": -100.0}).status_code == 200
    assert manager.calls[-1].params.logit_bias == {5: 2.0, 7: -100.0}
    assert chat(client, logit_bias={}).status_code == 200
    assert manager.calls[-1].params.logit_bias == {}
    assert_error(chat(client, logit_bias={str(i): 1 for i in range(301)}), 400, "logit_bias")
    assert_error(chat(client, logit_bias={"-1": 1}), 400, "logit_bias")


@pytest.mark.parametrize("key", ["-1", "100", "2147483647", "2147483648", "9" * 20])
def test_logit_bias_ids_outside_the_vocabulary_get_one_message(client: TestClient, key: str) -> None:
    """-1 said "outside the vocabulary >= 0" and 2^31 and above named their 32-bit storage with a null param."""
    for send in (completion, chat):
        error = assert_error(send(client, logit_bias={key: 1}), 400, "logit_bias")
        assert error["message"] == f"logit_bias token id {int(key)} is outside the vocabulary [0, 100)"



def test_twenty_logprobs_on_both_endpoints(client: TestClient, manager: FakeManager) -> None:
    assert completion(client, logprobs=20).status_code == 200
    assert chat(client, logprobs=True, top_logprobs=20).status_code == 200
    assert_error(chat(client, logprobs=True, top_logprobs=21), 400, "top_logprobs")


def test_truncate_prompt_tokens_keeps_the_last_tokens(client: TestClient, manager: FakeManager) -> None:
    full = manager.served.encode_prompt("a b c d e f")
    data = completion(client, prompt="a b c d e f", truncate_prompt_tokens=3).json()
    # The BOS the tokenizer added stays, as in vLLM (which truncates in the tokenizer).
    assert manager.calls[-1].prompt_ids == [full[0], *full[-2:]]
    assert data["usage"]["prompt_tokens"] == 3
    completion(client, prompt=[5, 6, 7], truncate_prompt_tokens=10)
    assert manager.calls[-1].prompt_ids == [5, 6, 7]
    chat(client, truncate_prompt_tokens=2)
    assert len(manager.calls[-1].prompt_ids) == 2
    assert_error(completion(client, truncate_prompt_tokens=0), 400, "truncate_prompt_tokens")
    assert_error(completion(client, truncate_prompt_tokens=True), 400, "truncate_prompt_tokens")


# ---------------------------------------------------------------- vLLM structured outputs


@pytest.mark.parametrize("fields", [
    {"guided_regex": "[a-z]+"},
    {"guided_choice": ["yes", "no"]},
    {"guided_json": {"type": "object"}},
    {"guided_json": '{"type": "integer"}'},
    {"guided_grammar": 'start: "a" | "b"'},
    {"structured_outputs": {"regex": "\\d{3}"}},
    {"structured_outputs": {"choice": ["x", "say \"hi\""]}},
    {"structured_outputs": {"json": {"type": "array"}}},
    {"structured_outputs": {"json_object": True}},
    {"structured_outputs": {"grammar": 'start: "z"+'}},
    # The empty regex matches the empty text (it was refused as "must be a non-empty string").
    {"structured_outputs": {"regex": ""}},
    {"guided_regex": ""},
    # null on a known key is absent, structural_tag's too (it was refused as an unknown key).
    {"structured_outputs": {"structural_tag": None, "regex": "a"}},
    {"structured_outputs": {"json": None, "regex": "a"}},
])
def test_structured_output_params_become_a_grammar(client: TestClient, manager: FakeManager,
                                                   fields: dict[str, Any]) -> None:
    for send in (chat, completion):
        assert send(client, **fields).status_code == 200
        assert manager.calls[-1].params.grammar


@pytest.mark.parametrize(("fields", "param"), [
    ({"guided_regex": "(["}, "guided_regex"),
    ({"guided_choice": []}, "guided_choice"),
    ({"guided_choice": [""]}, "guided_choice"),
    ({"guided_json": "{not json"}, "guided_json"),
    ({"guided_json": {"type": 5}}, "guided_json"),
    ({"guided_grammar": "root ::= \"a\""}, "guided_grammar"),
    ({"structured_outputs": {}}, "structured_outputs"),
    ({"structured_outputs": {"structural_tag": None}}, "structured_outputs"),
    ({"structured_outputs": {"backend": "xgrammar"}}, "structured_outputs"),
    ({"structured_outputs": {"json_object": False}}, "structured_outputs.json_object"),
    ({"guided_regex": "a", "guided_choice": ["a"]}, "guided_choice"),
    ({"structured_outputs": {"regex": "a"}, "guided_regex": "b"}, "guided_regex"),
    ({"guided_regex": "a", "response_format": {"type": "json_object"}}, "response_format"),
    # A schema that compiles to a grammar over the stored size names the field it came from.
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "n", "schema": {
        "enum": [f"value{index}" for index in range(20_000)]}}}}, "response_format.json_schema.schema"),
    ({"guided_choice": [f"choice{index}" for index in range(5_000)]}, "guided_choice"),
])
def test_bad_structured_output_params_are_refused(client: TestClient, fields: dict[str, Any], param: str) -> None:
    assert_error(chat(client, **fields), 400, param)


@pytest.mark.parametrize(("fields", "param"), [
    ({"structured_outputs": {"structural_tag": "{}"}}, "structured_outputs.structural_tag"),
    ({"response_format": {"type": "structural_tag", "format": {"type": "const_string", "value": "hi"}}},
     "response_format.type"),
])
def test_structural_tags_are_refused_saying_why(client: TestClient, fields: dict[str, Any], param: str) -> None:
    """They were refused as an unknown key or an unknown response_format type, without the reason."""
    for send in (chat, completion):
        error = assert_error(send(client, **fields), 400, param)
        assert "structural_tag is not supported" in error["message"] and "llguidance" in error["message"]


@pytest.mark.parametrize(("fields", "param"), [
    ({"guided_regex": "[^\\s\\S]"}, "guided_regex"),
    ({"structured_outputs": {"grammar": 'start: /[^\\s\\S]/'}}, "structured_outputs.grammar"),
])
def test_a_grammar_that_matches_no_text_at_all_is_refused(client: TestClient, fields: dict[str, Any],
                                                          param: str) -> None:
    for send in (chat, completion):
        response = send(client, **fields)
        assert_error(response, 400, param)
        assert "admits no output at all" in response.json()["error"]["message"]
