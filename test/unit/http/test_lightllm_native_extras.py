"""LightLLM's /tokens and its POST probes, on the real app.

/tokens must count what /generate would count as the prompt of the same text and parameters, and
check its body as /generate does; /liveness and /readiness answer POST as they answer GET (LightLLM
serves both methods there), while the other probes keep their methods.
"""

from __future__ import annotations

from typing import Any

import pytest
from fastapi.testclient import TestClient

from api_fakes import BOS, FakeManager, assert_error
from lightllm.server.http.app import create_app
from lightllm.server.http.server_options import AuthPolicy, HttpServerOptions


def _generated_prompt(client: TestClient, manager: FakeManager, text: str, parameters: dict[str, Any]) -> list[int]:
    response = client.post("/generate", json={"inputs": text, "parameters": {
        **parameters, "max_new_tokens": max(1, parameters.get("min_new_tokens", 0))}})
    assert response.status_code == 200, response.text
    return manager.calls[-1].prompt_ids


@pytest.mark.parametrize("method", ["GET", "POST"])
@pytest.mark.parametrize("parameters", [
    {}, {"add_special_tokens": False}, {"add_special_tokens": True, "temperature": 0.5, "do_sample": True},
    # No max_new_tokens: a min_new_tokens above /generate's default of 16 is not refused for it.
    {"min_new_tokens": 40, "regular_constraint": "[a-z]+"},
])
def test_tokens_counts_the_prompt_generate_would_count(client: TestClient, manager: FakeManager, method: str,
                                                       parameters: dict[str, Any]) -> None:
    text = "hello there general kenobi"
    expected = _generated_prompt(client, manager, text, parameters)
    response = client.request(method, "/tokens", json={"text": text, "parameters": parameters})
    assert response.status_code == 200, response.text
    assert response.json() == {"ntokens": len(expected)}
    assert (expected[0] == BOS) is parameters.get("add_special_tokens", True)


def test_tokens_counts_an_empty_text_and_takes_lightllms_empty_multimodal_params(client: TestClient) -> None:
    assert client.post("/tokens", json={"text": ""}).json() == {"ntokens": 1}  # the BOS alone
    empty = {"text": "a b", "multimodal_params": {"images": [], "audios": []}, "parameters": None}
    assert client.post("/tokens", json=empty).json() == {"ntokens": 3}


@pytest.mark.parametrize("body, param", [
    ({}, "text"),
    ({"text": 5}, "text"),
    ({"text": "a", "inputs": "a"}, "inputs"),
    ({"text": "a", "parameters": {"temperature": -1}}, "parameters.temperature"),
    ({"text": "a", "parameters": {"max_new_tokens": 0}}, "parameters.max_new_tokens"),
    ({"text": "a", "parameters": {"unknown_knob": 1}}, "parameters.unknown_knob"),
    ({"text": "a", "parameters": {"regular_constraint": "(unclosed"}}, "parameters.regular_constraint"),
    ({"text": "a", "parameters": {"min_new_tokens": 9, "max_new_tokens": 8}}, "parameters.min_new_tokens"),
    ({"text": "a", "multimodal_params": {"images": [{"type": "url", "data": "x"}]}}, "multimodal_params"),
])
def test_tokens_refuses_what_generate_refuses_naming_the_field(client: TestClient, body: dict[str, Any],
                                                                 param: str) -> None:
    error = assert_error(client.post("/tokens", json=body), 400, param)
    if "parameters" in body or "multimodal_params" in body:
        generate = {"inputs": "a", **{key: value for key, value in body.items() if key != "text"}}
        assert client.post("/generate", json=generate).json()["error"]["message"] == error["message"]


def test_tokens_needs_the_api_key_and_is_in_the_openapi_document() -> None:
    client = TestClient(create_app(FakeManager(), HttpServerOptions(auth=AuthPolicy(api_keys=("k",)))))
    assert_error(client.post("/tokens", json={"text": "a"}), 401, None, "missing_api_key")
    assert client.post("/tokens", json={"text": "a"}, headers={"Authorization": "Bearer k"}).json() == {"ntokens": 2}
    paths = client.get("/openapi.json", headers={"Authorization": "Bearer k"}).json()["paths"]
    for method in ("get", "post"):
        schema = paths["/tokens"][method]["requestBody"]["content"]["application/json"]["schema"]
        assert schema == {"$ref": "#/components/schemas/NativeTokenCountRequest"}


def test_lightllms_liveness_and_readiness_answer_post(client: TestClient, manager: FakeManager) -> None:
    assert client.post("/liveness").json() == {"status": "alive"}
    assert client.post("/readiness").json() == {"status": "ok"}
    manager.healthy = False
    assert_error(client.post("/readiness"), 503)
    assert client.post("/liveness").json() == {"status": "alive"}
    # The other probes keep their methods: LightLLM serves /healthz and /health on GET and HEAD only.
    for path in ("/healthz", "/health", "/health/live", "/health/ready"):
        assert_error(client.post(path), 405, code="method_not_allowed")


def test_post_probes_need_no_api_key() -> None:
    client = TestClient(create_app(FakeManager(), HttpServerOptions(auth=AuthPolicy(api_keys=("k",)))))
    assert client.post("/liveness").status_code == 200
    assert client.post("/readiness").status_code == 200
