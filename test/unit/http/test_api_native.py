"""Service and LightLLM-native endpoints: validation, error bodies and response shapes."""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any

import pytest
from fastapi.testclient import TestClient

from api_fakes import MODEL, FakeManager, assert_error, sse_events
from lightllm.server.http.app import create_app
from lightllm.server.http.server_options import AuthPolicy, HttpServerOptions


# ---------------------------------------------------------------- service endpoints


def test_models_lists_the_served_model(client: TestClient) -> None:
    data = client.get("/v1/models").json()
    assert data["object"] == "list"
    [card] = data["data"]
    assert {key: card[key] for key in ("id", "object", "owned_by", "max_model_len", "root", "parent")} == {
        "id": MODEL, "object": "model", "owned_by": "lightllm", "max_model_len": 64, "root": MODEL, "parent": None}
    assert isinstance(card["created"], int) and card["created"] > 0
    # vLLM's shape: `vllm bench serve` without --model reads data[0]["root"].
    assert card["permission"][0]["object"] == "model_permission"
    assert client.get(f"/v1/models/{MODEL}").json()["id"] == MODEL
    assert_error(client.get("/v1/models/other"), 404, "model", "model_not_found")


def test_health_and_metrics(client: TestClient, manager: FakeManager) -> None:
    assert client.get("/health").json() == {"status": "ok"}
    assert client.head("/health").status_code == 200
    # LightLLM's probe paths answer as ours.
    assert [client.get(path).json() for path in ("/healthz", "/readiness", "/liveness")] == [
        {"status": "ok"}, {"status": "ok"}, {"status": "alive"}]
    manager.healthy = False
    assert_error(client.get("/health"), 503)
    assert_error(client.get("/healthz"), 503)
    assert_error(client.get("/readiness"), 503)
    assert client.get("/liveness").json() == {"status": "alive"}
    response = client.get("/metrics")
    assert response.status_code == 200
    assert response.text == "lightllm_requests_total 3\n"
    assert response.headers["content-type"].startswith("text/plain; version=0.0.4")


def test_unknown_route_and_method_are_json_errors(client: TestClient) -> None:
    assert_error(client.get("/v1/nothing"), 404, code="not_found")
    assert_error(client.get("/v1/completions"), 405, code="method_not_allowed")


# ---------------------------------------------------------------- native endpoints


def test_native_generate_shape(client: TestClient, manager: FakeManager) -> None:
    body = {"inputs": "hello", "parameters": {"max_new_tokens": 5, "stop_sequences": "END", "do_sample": False,
                                              "return_details": True, "logprobs": 1}}
    data = client.post("/generate", json=body).json()
    assert data["generated_text"] == [" w0 w2"]
    assert data["count_output_tokens"] == 3 and data["finish_reason"] == "stop"
    assert data["prompt_tokens"] == 2 and data["prompt_cache_len"] == 2
    details = data["details"]
    assert details["count_output_tokens"] == 3 and details["finish_reason"] == "stop"
    assert details["tokens"][0] == {"id": 20, "text": " w0", "logprob": -0.5, "special": False,
                                    "top_logprobs": {"20": -0.5}}
    params = manager.calls[0].params
    assert params.stop_sequences == ["END"] and params.do_sample is False and params.max_new_tokens == 5
    assert "details" not in client.post("/generate", json={"inputs": "hello"}).json()


def test_native_special_flag_covers_added_special_tokens() -> None:
    # Llama 3's header tokens are added tokens flagged special, not in all_special_ids: skip_special_tokens
    # hides their text, so the record must say they are special.
    manager = FakeManager()
    manager.served.tokenizer.added_tokens_decoder = {20: SimpleNamespace(special=True),
                                                     21: SimpleNamespace(special=False)}
    client = TestClient(create_app(manager), raise_server_exceptions=False)
    body = {"inputs": "hello", "parameters": {"max_new_tokens": 5, "return_details": True}}
    tokens = client.post("/generate", json=body).json()["details"]["tokens"]
    assert [(token["id"], token["special"]) for token in tokens][:2] == [(20, True), (21, False)]


def test_native_stream_shape(client: TestClient) -> None:
    events = sse_events(client.post("/generate_stream", json={"inputs": "hello", "parameters": {"max_new_tokens": 3}}))
    assert "[DONE]" not in events and len(events) == 3
    assert events[0] == {"token": {"id": 20, "text": " w0", "logprob": -0.5, "special": False,
                                   "count_output_tokens": 1, "prompt_tokens": 2, "prompt_cache_len": 2},
                         "generated_text": None, "finished": False, "finish_reason": None, "details": None}
    last = events[-1]
    assert last["finished"] is True and last["finish_reason"] == "length"
    assert last["generated_text"] == " w0 w2" and last["token"]["count_output_tokens"] == 3


def test_native_logprobs_are_reported_or_refused(client: TestClient, manager: FakeManager) -> None:
    # A stream carries the alternatives on each token; /generate only in its details, so without
    # return_details the field would change nothing and is refused.
    body = {"inputs": "hello", "parameters": {"max_new_tokens": 2, "logprobs": 1}}
    events = sse_events(client.post("/generate_stream", json=body))
    assert events[0]["token"]["top_logprobs"] == {"20": -0.5}
    assert_error(client.post("/generate", json=body), 400, "parameters.logprobs")
    assert len(manager.calls) == 1
    # logprobs 0 asks for no alternatives: an empty object, as documented ("with N entries").
    none = {"inputs": "hello", "parameters": {"max_new_tokens": 2, "logprobs": 0}}
    assert [event["token"]["top_logprobs"] for event in sse_events(client.post("/generate_stream", json=none))] == [{}, {}]
    details = client.post("/generate", json={**none, "parameters": {**none["parameters"], "return_details": True}}).json()
    assert [token["top_logprobs"] for token in details["tokens"]] == [{}, {}]


def test_high_priority_request_reaches_manager(manager: FakeManager) -> None:
    options = HttpServerOptions(auth=AuthPolicy(admin_keys=("admin-key",)))
    client = TestClient(create_app(manager, options), headers={"authorization": "Bearer admin-key"})
    assert client.post("/generate", json={"inputs": "hi", "high_priority_request": True}).status_code == 200
    client.post("/generate_stream", json={"inputs": "hi"})
    assert [call.high_priority for call in manager.calls] == [True, False]


@pytest.mark.parametrize(
    ("body", "param"),
    [
        ({"inputs": "hi", "parameters": {"infer_high_priority": -1}}, "parameters.infer_high_priority"),
        ({"inputs": "hi", "infer_high_priority": -1}, "infer_high_priority"),
        ({"inputs": "hi", "parameters": {"n": 3, "best_of": 2}}, "parameters.best_of"),
        ({"inputs": "hi", "parameters": {"n": 17}}, "parameters.n"),
        ({"inputs": "hi", "parameters": {"print_eos_token": "yes"}}, "parameters.print_eos_token"),
        ({"inputs": "hi", "parameters": {"exponential_decay_length_penalty": [4]}},
         "parameters.exponential_decay_length_penalty"),
        ({"inputs": "hi", "parameters": {"exponential_decay_length_penalty": [-1, 1.1]}},
         "parameters.exponential_decay_length_penalty"),
        ({"inputs": "hi", "parameters": {"exponential_decay_length_penalty": [4, 0.5]}},
         "parameters.exponential_decay_length_penalty"),
        ({"inputs": "hi", "parameters": {"exponential_decay_length_penalty": [4, 11]}},
         "parameters.exponential_decay_length_penalty"),
        ({"inputs": "hi", "parameters": {"skip_special_tokens": "no"}}, "parameters.skip_special_tokens"),
        ({"inputs": "hi", "high_priority_request": "yes"}, "high_priority_request"),
        ({"inputs": ""}, "inputs"),
        ({"inputs": 5}, "inputs"),
        ({"parameters": {}}, "inputs"),
        ({"inputs": "hi", "parameters": {"top_p": 2.0}}, "parameters.top_p"),
        ({"inputs": "hi", "parameters": {"min_p": 2.0}}, "parameters.min_p"),
        ({"inputs": "hi", "parameters": {"max_new_tokens": 0}}, "parameters.max_new_tokens"),
        ({"inputs": "hi", "parameters": {"temperature": -1}}, "parameters.temperature"),
        ({"inputs": "hi", "parameters": {"stop_token_ids": [100]}}, "parameters.stop_token_ids"),
        ({"inputs": "hi", "multimodal_params": {"images": [{"type": "url"}]}}, "multimodal_params"),
        ({"inputs": "hi", "multimodal_params": {"foo": 0}}, "multimodal_params"),
    ],
)
@pytest.mark.parametrize("path", ["/generate", "/generate_stream"])
def test_native_invalid_requests(client: TestClient, manager: FakeManager, body: dict[str, Any], param: str,
                                 path: str) -> None:
    error = assert_error(client.post(path, json=body), 400, param)
    assert param.split(".")[-1] in error["message"]
    assert manager.calls == []


def test_native_accepts_absent_multimodal_params(client: TestClient) -> None:
    for extra in ({}, {"multimodal_params": None}, {"multimodal_params": {"images": []}}):
        assert client.post("/generate", json={"inputs": "hi", **extra}).status_code == 200


def test_native_lightllm_parameters(client: TestClient, manager: FakeManager) -> None:
    answer = client.post("/generate", json={"inputs": "hi there", "parameters": {
        "n": 2, "return_details": True, "add_special_tokens": False, "skip_special_tokens": False,
        "input_penalty": True, "presence_penalty": 0.5}}).json()
    assert len(answer["generated_text"]) == 2 and len(answer["tokens"]) == 2
    assert answer["finish_reason"] == ["stop", "stop"] and answer["count_output_tokens"] == [3, 3]
    assert all(call.prompt_ids == manager.served.encode_prompt("hi there", add_special_tokens=False)
               for call in manager.calls)
    # Each choice is a request of its own (and counts its prompt, as vLLM counts it once per sequence).
    assert len(manager.calls) == 2 and manager.calls[0].spec is not manager.calls[1].spec
    params = manager.calls[0].params
    assert params.skip_special_tokens is False and params.input_penalty is True
    assert params.print_eos_token is False and params.exponential_decay_start is None
    manager.calls.clear()
    client.post("/generate", json={"inputs": "hi", "parameters": {
        "print_eos_token": True, "exponential_decay_length_penalty": [4, 1.5]}})
    params = manager.calls[0].params
    assert params.print_eos_token is True
    assert (params.exponential_decay_start, params.exponential_decay_factor) == (4, 1.5)
    # Defaults as LightLLM: 16 new tokens, tokens at the top level with return_details.
    manager.calls.clear()
    single = client.post("/generate", json={"inputs": "hi", "parameters": {"return_details": True}}).json()
    assert manager.calls[0].params.max_new_tokens == 16
    assert single["tokens"] == single["details"]["tokens"] and len(single["tokens"]) == 3
    streamed = client.post("/generate_stream", json={"inputs": "hi", "parameters": {"n": 2}})
    assert_error(streamed, 400, "parameters.n")


def test_null_is_the_same_as_leaving_a_native_field_out(client: TestClient, manager: FakeManager) -> None:
    """Every parameter, as on the OpenAI endpoints (some were refused, others accepted)."""
    from lightllm.server.http.native_models import NativeParameters

    names = sorted(NativeParameters.model_fields)
    absent = client.post("/generate", json={"inputs": "hello", "parameters": {}})
    assert absent.status_code == 200
    reply = client.post("/generate", json={"inputs": "hello", "parameters": {name: None for name in names},
                                           "multimodal_params": None})
    assert reply.status_code == 200, reply.text
    assert manager.calls[-1].params == manager.calls[-2].params
    assert client.post("/generate", json={"inputs": "hello", "parameters": None}).status_code == 200
    assert_error(client.post("/generate", json={"inputs": "hello", "parameters": {"no_such_field": None}}), 400,
                 "parameters.no_such_field")
