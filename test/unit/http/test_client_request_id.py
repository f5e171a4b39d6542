"""What a vLLM client may rely on about ids and names: ``X-Request-Id``, ``model: ""``, a card's ``root``."""

from __future__ import annotations

import json
from typing import Any

import pytest
from fastapi.testclient import TestClient

from api_fakes import MODEL, FakeManager, assert_error, chat, completion
from lightllm.server.http.app import create_app


def _first_id(response: Any, stream: bool) -> str:
    if not stream:
        return response.json()["id"]
    return json.loads(response.text.split("data: ", 2)[1].split("\n")[0])["id"]


@pytest.mark.parametrize("stream", [False, True])
def test_the_request_id_header_names_the_response(client: TestClient, stream: bool) -> None:
    # vLLM: the header wins over the body's request_id; gateways correlate on it.
    for send, prefix in ((completion, "cmpl-"), (chat, "chatcmpl-")):
        response = client.post("/v1/completions" if send is completion else "/v1/chat/completions",
                               json=_body(send, stream, request_id="from-body"),
                               headers={"X-Request-Id": "trace-7f3a.b:1"})
        assert response.status_code == 200, response.text
        assert _first_id(response, stream) == f"{prefix}trace-7f3a.b:1"
        assert response.headers["x-request-id"] == f"{prefix}trace-7f3a.b:1"
    # Without the header the body's id is used, and without either a random one.
    response = completion(client, request_id="from-body")
    assert response.json()["id"] == "cmpl-from-body"


def _body(send: Any, stream: bool, **fields: Any) -> dict[str, Any]:
    if send is completion:
        return {"model": MODEL, "prompt": "hello there", "stream": stream, **fields}
    return {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "stream": stream, **fields}


@pytest.mark.parametrize("value", ["has space", "x" * 129, "semi;colon", ""])
def test_a_request_id_header_that_is_no_id_is_refused(client: TestClient, manager: FakeManager, value: str) -> None:
    response = client.post("/v1/completions", json={"model": MODEL, "prompt": "hi"}, headers={"X-Request-Id": value})
    error = assert_error(response, 400, "X-Request-Id")
    assert "X-Request-Id" in error["message"]
    assert not manager.calls


def test_a_repeated_request_id_header_is_refused(client: TestClient, manager: FakeManager) -> None:
    response = client.post("/v1/completions", json={"model": MODEL, "prompt": "hi"},
                           headers=[("X-Request-Id", "a"), ("X-Request-Id", "b")])
    assert_error(response, 400, "X-Request-Id")
    assert not manager.calls


def test_an_empty_model_means_the_served_one(client: TestClient) -> None:
    # vLLM serves a request whose model is "" with its model (only a wrong name is a 404).
    for send in (completion, chat):
        response = send(client, model="")
        assert response.status_code == 200, response.text
        assert response.json()["model"] == MODEL
    assert_error(completion(client, model="other"), 404, "model", "model_not_found")


def test_a_model_card_root_is_the_checkpoint_path(manager: FakeManager) -> None:
    # `vllm bench serve` without --model loads its tokenizer from the card's root.
    manager.served.model_path = "/models/tiny-llama"
    client = TestClient(create_app(manager), raise_server_exceptions=False)
    [card] = client.get("/v1/models").json()["data"]
    assert card["id"] == MODEL and card["root"] == "/models/tiny-llama"
    assert client.get(f"/v1/models/{MODEL}").json()["root"] == "/models/tiny-llama"
