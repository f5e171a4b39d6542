"""vLLM's /tokenize, /detokenize, /version and /ping on the real app.

/tokenize must give the ids the generation endpoints give the model: a chat as
/v1/chat/completions renders it (compared with what that endpoint hands the manager), a text
prompt as /v1/completions encodes it. Every refusal is a 400 (404 for an unknown model) naming
the field. /ping answers what /health answers, on a normal server and on a PD master.
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

import pytest
from fastapi.testclient import TestClient

import lightllm
from api_fakes import BOS, MODEL, FakeManager, FakeTokenizer, assert_error
from lightllm.server.http.app import create_app
from lightllm.server.http.service.health import PROBE_PATHS, health_answer
from lightllm.server.http.transport.probe_parsing import health_path, may_be_health
from lightllm.server.http.server_options import AuthPolicy, HttpLimits, HttpServerOptions

ROOT = Path(__file__).resolve().parents[3]
USER = [{"role": "user", "content": "hi there"}]
PREFILL = [{"role": "user", "content": "count"}, {"role": "assistant", "content": "one two"}]
TOOLS = [{"type": "function", "function": {"name": "get_weather", "parameters": {
    "type": "object", "properties": {"city": {"type": "string"}}}}}]


class SpellingTokenizer(FakeTokenizer):
    """The fake tokenizer with vocabulary strings, as Hugging Face tokenizers have them."""

    def convert_ids_to_tokens(self, ids: list[int]) -> list[str]:
        return [f"tok{token_id}" for token_id in ids]


def _tokenize(client: TestClient, **fields: Any) -> Any:
    return client.post("/tokenize", json=fields)


def _chat_prompt(client: TestClient, manager: FakeManager, **fields: Any) -> tuple:
    """What /v1/chat/completions gave the manager: prompt ids, rendered messages, template options."""
    response = client.post("/v1/chat/completions", json={"model": MODEL, "max_tokens": 1, **fields})
    assert response.status_code == 200, response.text
    return manager.calls[-1].prompt_ids, manager.served.chat_messages[-1], manager.served.template_options


# ---------------------------------------------------------------- /tokenize: the same ids as generation


@pytest.mark.parametrize("fields", [
    {"messages": USER},
    {"messages": PREFILL, "add_generation_prompt": False, "continue_final_message": True},
    {"messages": PREFILL, "add_generation_prompt": False},
    {"messages": USER, "chat_template_kwargs": {"enable_thinking": False}},
    # The chat endpoint's template fields (a RAG template's documents were refused as unknown here).
    {"messages": USER, "documents": [{"title": "A", "text": "B"}], "reasoning_effort": "low"},
    {"messages": [{"role": "developer", "content": [{"type": "text", "text": "a"}, {"type": "text", "text": "b"}]},
                  *USER]},
    {"messages": [*USER, {"role": "assistant", "content": None, "tool_calls": [
        {"id": "c1", "type": "function", "function": {"name": "get_weather", "arguments": "{\"city\": \"x\"}"}}]},
        {"role": "tool", "tool_call_id": "c1", "content": "sunny"}]},
], ids=["plain", "continue_final_message", "no_generation_prompt", "template_kwargs", "template_fields",
        "parts_developer", "tool_history"])
def test_chat_tokenize_gives_the_prompt_chat_completions_uses(client: TestClient, manager: FakeManager,
                                                             fields: dict[str, Any]) -> None:
    ids, messages, options = _chat_prompt(client, manager, **fields)
    answer = _tokenize(client, model=MODEL, **fields)
    assert answer.status_code == 200, answer.text
    body = answer.json()
    assert body == {"count": len(ids), "max_model_len": manager.served.max_req_total_len, "tokens": ids, "token_strs": None}
    # The manager rendered the same messages with the same template options.
    assert manager.served.chat_messages[-1] == messages and manager.served.template_options == options


def test_chat_tokenize_passes_the_tools_to_the_template(client: TestClient, manager: FakeManager) -> None:
    # Without --tool_call_parser the chat endpoint takes tools with tool_choice "none" (the template
    # still gets them); /tokenize has no tool_choice and renders them the same way.
    _chat_prompt(client, manager, messages=USER, tools=TOOLS, tool_choice="none")
    options = manager.served.template_options
    assert options["chat_template_kwargs"]["tools"] == TOOLS
    assert _tokenize(client, messages=USER, tools=TOOLS).status_code == 200
    # The same rendering; only the refusal of tools the template drops is the chat endpoint's own
    # (under none: /tokenize generates nothing).
    assert manager.served.template_options == {**options, "check_tools_read": False}
    assert_error(_tokenize(client, messages=USER, tools=[{"type": "function", "function": {"name": "bad name"}}]),
                 400, "tools.0.function.name")


@pytest.mark.parametrize("special", [True, False])
def test_completion_tokenize_is_encode_prompt(client: TestClient, manager: FakeManager, special: bool) -> None:
    prompt = "hello there general kenobi"
    expected = manager.served.encode_prompt(prompt, add_special_tokens=special)
    assert (expected[0] == BOS) is special
    body = _tokenize(client, prompt=prompt, add_special_tokens=special).json()
    assert body == {"count": len(expected), "max_model_len": 64, "tokens": expected, "token_strs": None}
    # And /v1/completions gives the model the same ids.
    assert client.post("/v1/completions", json={"prompt": prompt, "max_tokens": 1,
                                                 "add_special_tokens": special}).status_code == 200
    assert manager.calls[-1].prompt_ids == expected


def test_completion_tokenize_defaults_to_special_tokens_and_nulls_mean_defaults(client: TestClient) -> None:
    default = _tokenize(client, prompt="a b").json()
    assert default["tokens"][0] == BOS
    nulls = _tokenize(client, prompt="a b", model=None, add_special_tokens=None, return_token_strs=None).json()
    assert nulls == default
    # An empty prompt is an answer, not an error: vLLM counts it too.
    assert _tokenize(client, prompt="", add_special_tokens=False).json()["tokens"] == []


def test_a_prompt_longer_than_the_context_is_counted_whole(client: TestClient) -> None:
    # vLLM's /tokenize answers over-long prompts (count > max_model_len tells the client it will not fit).
    body = _tokenize(client, prompt=" ".join(["word"] * 1000)).json()
    assert body["count"] == 1001 and body["max_model_len"] == 64


def test_the_character_bound_of_the_generation_endpoints_applies() -> None:
    client = TestClient(create_app(FakeManager(), HttpServerOptions(limits=HttpLimits(prompt_chars_per_token=2))))
    assert _tokenize(client, prompt="p" * 128).status_code == 200
    error = assert_error(_tokenize(client, prompt="p" * 129), 400, "prompt", "context_length_exceeded")
    assert "129 characters" in error["message"]
    assert_error(_tokenize(client, messages=[{"role": "user", "content": "m" * 129}]), 400, "messages",
                 "context_length_exceeded")


def test_a_chat_the_template_expands_beyond_the_character_bound_is_refused_not_tokenized_whole() -> None:
    """The bound counted the message texts only: a trusted request template that expanded a short chat
    ({{ "x " * 10000000 }}) was tokenized whole (26 s, 4.5 GB). Beyond the context but within the
    bound, a chat is still counted, as vLLM counts it."""
    client = TestClient(create_app(FakeManager(), HttpServerOptions(limits=HttpLimits(prompt_chars_per_token=8))))
    # Each message renders as two words ("user: m"), each one token: 40 messages are 80 tokens
    # (beyond the 64-token context) in 319 characters (within the 512-character bound). Empty
    # messages count no characters but render as "user:": 1000 of them render as 6999 characters.
    within = _tokenize(client, messages=[{"role": "user", "content": "m"}] * 40)
    assert within.status_code == 200 and within.json()["count"] == 81  # and the fake template's BOS
    error = assert_error(_tokenize(client, messages=[{"role": "user", "content": ""}] * 1000), 400, "messages",
                         "context_length_exceeded")
    assert ("The messages as the chat template renders them are 6999 characters, longer than the 512 characters a "
            "prompt may have here (--prompt_chars_per_token)") in error["message"]


def test_token_strs(client: TestClient, manager: FakeManager) -> None:
    # The fake tokenizer has no vocabulary strings: refused naming the field, not answered with nulls.
    assert_error(_tokenize(client, prompt="a b", return_token_strs=True), 400, "return_token_strs")
    manager.served.tokenizer = SpellingTokenizer()
    body = _tokenize(client, prompt="a b", return_token_strs=True).json()
    assert body["token_strs"] == [f"tok{token_id}" for token_id in body["tokens"]]
    chat = _tokenize(client, messages=USER, return_token_strs=True).json()
    assert chat["token_strs"] == [f"tok{token_id}" for token_id in chat["tokens"]]
    assert _tokenize(client, prompt="a b", return_token_strs=False).json()["token_strs"] is None


# ---------------------------------------------------------------- /tokenize refusals


@pytest.mark.parametrize(("fields", "param"), [
    ({"prompt": "x", "temperature": 0.5}, "temperature"),
    ({"prompt": "x", "messages": USER}, "prompt"),
    ({}, "prompt"),
    ({"messages": None}, "messages"),
    ({"messages": []}, "messages"),
    ({"messages": USER, "documents": [{"text": 3}]}, "documents.0.text"),
    ({"messages": USER, "tool_choice": "none"}, "tool_choice"),
    ({"prompt": 5}, "prompt"),
    ({"prompt": ["a", "b"]}, "prompt"),
    ({"prompt": [1, 2]}, "prompt"),
    ({"prompt": "x", "add_special_tokens": "yes"}, "add_special_tokens"),
    ({"prompt": "x", "return_token_strs": 1}, "return_token_strs"),
    ({"prompt": "x", "model": 3}, "model"),
    ({"messages": "hi"}, "messages"),
    ({"messages": [{"role": "robot", "content": "x"}]}, "messages.0.role"),
    ({"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "u"}}]}]},
     "messages.0.content"),
    ({"messages": USER, "add_generation_prompt": "no"}, "add_generation_prompt"),
    ({"messages": USER, "chat_template_kwargs": []}, "chat_template_kwargs"),
    ({"messages": USER, "chat_template_kwargs": {"add_generation_prompt": False}}, "chat_template_kwargs"),
    ({"messages": PREFILL, "continue_final_message": True}, "continue_final_message"),
    ({"messages": USER, "continue_final_message": True, "add_generation_prompt": False}, "continue_final_message"),
    ({"messages": [{"role": "tool", "content": "r"}]}, "messages.0.tool_call_id"),
    ({"messages": [{"role": "user", "content": None}]}, "messages.0.content"),
    ({"messages": [{"role": "user", "content": "BREAK_TEMPLATE"}]}, "messages"),
    ({"messages": USER, "response_format": {"type": "json_object"}}, "response_format"),
    ({"messages": USER, "media_io_kwargs": {"image": {}}}, "media_io_kwargs"),
    ({"messages": USER, "mm_processor_kwargs": {"size": 3}}, "mm_processor_kwargs"),
    ({"prompt": "x", "mm_processor_kwargs": {"size": 3}}, "mm_processor_kwargs"),
])
def test_tokenize_refusals_name_the_field(client: TestClient, manager: FakeManager, fields: dict[str, Any],
                                          param: str) -> None:
    assert_error(_tokenize(client, **fields), 400, param)
    assert not manager.calls


def test_fields_without_effect_are_taken_when_null(client: TestClient) -> None:
    nulls = {"response_format": None, "media_io_kwargs": None, "mm_processor_kwargs": None, "tools": None,
             "chat_template": None, "chat_template_kwargs": None}
    assert _tokenize(client, messages=USER, **nulls).json() == _tokenize(client, messages=USER).json()
    error = assert_error(_tokenize(client, messages=USER, response_format={"type": "text"}), 400, "response_format")
    assert "not supported on /tokenize" in error["message"]


def test_a_request_template_follows_the_chat_endpoints_trust_rule(manager: FakeManager) -> None:
    template = "{% for m in messages %}{{ m.content }}{% endfor %}"
    refused = _tokenize(TestClient(create_app(manager)), messages=USER, chat_template=template)
    assert "--trust_request_chat_template" in assert_error(refused, 400, "chat_template")["message"]
    trusting = TestClient(create_app(manager, HttpServerOptions(trust_request_chat_template=True)))
    assert _tokenize(trusting, messages=USER, chat_template=template).status_code == 200
    tokenized = manager.served.template_options
    assert tokenized["chat_template_kwargs"]["chat_template"] == template
    _chat_prompt(trusting, manager, messages=USER, chat_template=template)
    assert manager.served.template_options == tokenized


@pytest.mark.parametrize("path", ["/tokenize", "/detokenize"])
def test_the_model_rule_of_the_openai_endpoints(client: TestClient, path: str) -> None:
    body = {"prompt": "a"} if path == "/tokenize" else {"tokens": [3]}
    for model in (MODEL, "", None):
        assert client.post(path, json={**body, "model": model}).status_code == 200
    error = assert_error(client.post(path, json={**body, "model": "gpt-4"}), 404, "model", "model_not_found")
    assert MODEL in error["message"]


@pytest.mark.parametrize("path", ["/tokenize", "/detokenize"])
def test_bodies_that_are_not_a_json_object(client: TestClient, path: str) -> None:
    assert_error(client.post(path, content=b"{not json", headers={"content-type": "application/json"}), 400)
    assert_error(client.post(path, json=[1, 2]), 400)
    assert_error(client.post(path, content=b'{"prompt": "a", "prompt": "b"}'), 400)
    refused = client.post(path, content=b"prompt=a", headers={"content-type": "application/x-www-form-urlencoded"})
    assert_error(refused, 415, None, "unsupported_media_type")
    assert_error(client.get(path), 405, None, "method_not_allowed")


def test_the_body_size_limit_applies() -> None:
    client = TestClient(create_app(FakeManager(), HttpServerOptions(limits=HttpLimits(max_body_bytes=1000))))
    assert_error(client.post("/tokenize", json={"prompt": "x" * 2000}), 413, None, "request_too_large")


# ---------------------------------------------------------------- /detokenize


def test_detokenize_decodes_with_the_manager_tokenizer(client: TestClient) -> None:
    assert client.post("/detokenize", json={"tokens": [5, 1, 99]}).json() == {"prompt": "<5><1><99>"}
    # Integral floats are integers, as on every integer field; an empty list is the empty text.
    assert client.post("/detokenize", json={"tokens": [5.0]}).json() == {"prompt": "<5>"}
    assert client.post("/detokenize", json={"tokens": []}).json() == {"prompt": ""}


def test_tokenize_then_detokenize_round_trips(client: TestClient) -> None:
    ids = _tokenize(client, prompt="round trip").json()["tokens"]
    assert client.post("/detokenize", json={"tokens": ids}).json()["prompt"] == "".join(f"<{i}>" for i in ids)


@pytest.mark.parametrize("tokens", [[100], [-1], [5, 2**70], [True], [1.5], ["5"], 5, None, [[1]]])
def test_detokenize_refuses_ids_outside_the_vocabulary_and_bad_types(client: TestClient, tokens: Any) -> None:
    assert_error(client.post("/detokenize", json={"tokens": tokens}), 400,
                 "tokens.0" if tokens in ([True], [1.5], ["5"], [[1]]) else "tokens")


def test_detokenize_is_bounded_by_the_context_length(client: TestClient, manager: FakeManager) -> None:
    limit = manager.served.max_req_total_len
    assert client.post("/detokenize", json={"tokens": [3] * limit}).status_code == 200
    error = assert_error(client.post("/detokenize", json={"tokens": [3] * (limit + 1)}), 400, "tokens")
    assert f"({limit})" in error["message"]
    assert_error(client.post("/detokenize", json={"tokens": [3], "skip_special_tokens": True}), 400,
                 "skip_special_tokens")


# ---------------------------------------------------------------- /version and /ping


def test_version_is_the_package_version(client: TestClient) -> None:
    assert client.get("/version").json() == {"version": lightllm.__version__}
    # setup.py reads the same string (the one place it is written).
    setup = (ROOT / "setup.py").read_text()
    assert "version=VERSION" in setup and re.search(r"^\d+\.\d+\.\d+", lightllm.__version__)


@pytest.mark.parametrize("method", ["GET", "POST"])
def test_ping_answers_what_health_answers(client: TestClient, manager: FakeManager, method: str) -> None:
    ping = client.request(method, "/ping")
    assert (ping.status_code, ping.json()) == (200, {"status": "ok"})
    manager.healthy = False
    ping, health = client.request(method, "/ping"), client.get("/health")
    assert ping.status_code == health.status_code == 503
    assert ping.json() == health.json() and ping.json()["error"]["code"] == "unhealthy"
    assert client.head("/ping").status_code == 503


def test_ping_is_a_probe_the_front_door_answers() -> None:
    assert "/ping" in PROBE_PATHS
    assert health_path(b"GET /ping HTTP/1.1\r\nHost: x\r\n\r\n") == "/ping"
    assert health_path(b"POST /ping HTTP/1.1\r\nHost: x\r\n\r\n") is None
    assert may_be_health(b"GET /pi")
    for problem in (None, ("server_starting", "loading")):
        assert health_answer("/ping", lambda: problem) == health_answer("/health", lambda: problem)


def test_api_key_covers_the_new_endpoints_but_not_ping() -> None:
    client = TestClient(create_app(FakeManager(), HttpServerOptions(auth=AuthPolicy(api_keys=("k",)))))
    key = {"Authorization": "Bearer k"}
    for method, path, body in (("POST", "/tokenize", {"prompt": "a"}), ("POST", "/detokenize", {"tokens": [3]}),
                               ("GET", "/version", None)):
        assert_error(client.request(method, path, json=body), 401, None, "missing_api_key")
        assert client.request(method, path, json=body, headers=key).status_code == 200
    for method in ("GET", "POST", "HEAD"):
        assert client.request(method, "/ping").status_code == 200


def test_openapi_documents_the_new_routes(client: TestClient) -> None:
    document = client.get("/openapi.json").json()
    schema = document["paths"]["/tokenize"]["post"]["requestBody"]["content"]["application/json"]["schema"]
    assert schema == {"anyOf": [{"$ref": "#/components/schemas/TokenizeCompletionRequest"},
                                {"$ref": "#/components/schemas/TokenizeChatRequest"}]}
    assert {"TokenizeCompletionRequest", "TokenizeChatRequest", "DetokenizeRequest"} <= set(
        document["components"]["schemas"])
    for method in ("get", "post"):
        responses = document["paths"]["/ping"][method]["responses"]
        assert "401" not in responses and "503" in responses
    assert "401" not in document["paths"]["/version"]["get"]["responses"]  # no key on this server


# ---------------------------------------------------------------- a PD master, on a real tokenizer


@pytest.fixture(scope="module")
def pd_master(tiny_llama_dir: Path) -> tuple[Any, TestClient]:
    from lightllm.server.launch.arg_parser import make_argument_parser
    from lightllm.server.launch.args_check import validate_args
    from lightllm.server.launch.pd_master import build_master, check_master_flags
    from lightllm.server.pd.master.membership_api import readiness_router

    args = make_argument_parser().parse_args(["--run_mode", "pd_master", "--model_dir", str(tiny_llama_dir)])
    validate_args(args, 0)
    check_master_flags(args)
    manager, registry = build_master(args)
    app = create_app(manager, extra_routers=[readiness_router(registry, refusal=manager.refusal)])
    return manager, TestClient(app, raise_server_exceptions=False)


def test_pd_master_tokenizes_with_the_checkpoint_tokenizer(pd_master: tuple[Any, TestClient]) -> None:
    manager, client = pd_master
    tokenizer = manager.served.tokenizer
    text = tokenizer.apply_chat_template(PREFILL, tokenize=False, add_generation_prompt=True)
    expected = tokenizer(text, add_special_tokens=False)["input_ids"]
    body = client.post("/tokenize", json={"messages": PREFILL, "return_token_strs": True}).json()
    assert body["tokens"] == expected and body["count"] == len(expected)
    assert body["max_model_len"] == manager.served.max_req_total_len
    assert body["token_strs"] == tokenizer.convert_ids_to_tokens(expected)
    # add_special_tokens adds the tokenizer's BOS on top of the template's, as on /v1/chat/completions.
    added = client.post("/tokenize", json={"messages": PREFILL, "add_special_tokens": True}).json()["tokens"]
    assert added == tokenizer(text, add_special_tokens=True)["input_ids"] == [tokenizer.bos_token_id, *expected]
    prompt = "hello world, round trip"
    ids = client.post("/tokenize", json={"prompt": prompt, "add_special_tokens": False}).json()["tokens"]
    assert ids == tokenizer(prompt, add_special_tokens=False)["input_ids"]
    assert client.post("/detokenize", json={"tokens": ids}).json() == {"prompt": prompt}
    assert_error(client.post("/detokenize", json={"tokens": [manager.served.vocab_size]}), 400, "tokens")


def test_pd_master_ping_is_its_own_health(pd_master: tuple[Any, TestClient]) -> None:
    _, client = pd_master
    health = client.get("/health")
    assert health.status_code == 503 and health.json()["error"]["code"] == "pd_not_ready"
    for method in ("GET", "POST"):
        ping = client.request(method, "/ping")
        assert (ping.status_code, ping.json()) == (503, health.json())
    assert client.get("/version").json() == {"version": lightllm.__version__}


def test_template_call_arguments_in_chat_template_kwargs_are_refused_saying_where_each_belongs(
        client: TestClient) -> None:
    error = assert_error(_tokenize(client, messages=USER, chat_template_kwargs={"documents": [], "tokenize": True}),
                         400, "chat_template_kwargs")
    assert error["message"] == ("chat_template_kwargs must not set documents, tokenize (documents is a request "
                                "field: set it there; tokenize shapes the template call, which the server makes)")
