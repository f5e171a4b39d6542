"""The generated /openapi.json states what the probes, /metrics and the guarded routes really answer.

Health probes need no API key (so no 401) and say "not ready" or "stalled" with a 503 carrying the
error body; /metrics is served as Prometheus text, not JSON; /generate and /generate_stream answer
a priority asked for without the right to it with a 403; a keyed server declares its bearer scheme
on every operation it guards. Each claim is checked against the document and against the live
answer of the same app.
"""

from __future__ import annotations

from typing import Any

import pytest
from fastapi import APIRouter
from fastapi.testclient import TestClient

from api_fakes import FakeManager
from lightllm.server.http.app import create_app
from lightllm.server.http.service.health import PROBE_PATHS
from lightllm.server.http.server_options import AuthPolicy, HttpServerOptions

ERROR_REF = {"$ref": "#/components/schemas/ErrorResponse"}
PROBES = ("/health", "/health/ready", "/health/live")


@pytest.fixture(scope="module")
def keyed_client() -> TestClient:
    options = HttpServerOptions(auth=AuthPolicy(api_keys=("k",)))
    return TestClient(create_app(FakeManager(), options))


@pytest.fixture(scope="module")
def document(keyed_client: TestClient) -> dict[str, Any]:
    return keyed_client.get("/openapi.json", headers={"Authorization": "Bearer k"}).json()


@pytest.mark.parametrize("path", PROBES)
def test_probes_list_503_and_no_401(document: dict[str, Any], keyed_client: TestClient, path: str) -> None:
    responses = document["paths"][path]["get"]["responses"]
    assert "401" not in responses
    assert responses["503"]["content"]["application/json"]["schema"] == ERROR_REF
    assert responses["200"]["content"]["application/json"]["schema"]["required"] == ["status"]
    # The document's claim holds: a keyed server answers probes without a key.
    assert keyed_client.get(path).status_code == 200


def test_metrics_200_is_plain_text(document: dict[str, Any], keyed_client: TestClient) -> None:
    responses = document["paths"]["/metrics"]["get"]["responses"]
    assert set(responses["200"]["content"]) == {"text/plain"}
    assert responses["200"]["content"]["text/plain"]["schema"] == {"type": "string"}
    assert responses["401"]["content"]["application/json"]["schema"] == ERROR_REF
    answer = keyed_client.get("/metrics", headers={"Authorization": "Bearer k"})
    assert answer.status_code == 200 and answer.headers["content-type"].startswith("text/plain")


def test_404_only_where_a_path_names_something(document: dict[str, Any]) -> None:
    assert "404" in document["paths"]["/v1/models/{model_id}"]["get"]["responses"]
    for path in ("/v1/models", "/metrics", *PROBES):
        assert "404" not in document["paths"][path]["get"]["responses"], path


def test_no_component_is_left_that_nothing_refers_to(document: dict[str, Any]) -> None:
    """FastAPI's 422 schemas stayed after their 422s were removed (bodies are validated into 400s)."""
    text = str(document["paths"]) + str(document["components"]["schemas"])
    for name in document["components"]["schemas"]:
        assert f"#/components/schemas/{name}" in text, name
    assert not {"HTTPValidationError", "ValidationError"} & set(document["components"]["schemas"])


def test_generate_stream_says_it_always_streams(document: dict[str, Any]) -> None:
    ok = document["paths"]["/generate_stream"]["post"]["responses"]["200"]
    assert set(ok["content"]) == {"text/event-stream"} and "JSON" not in ok["description"]


@pytest.mark.parametrize("public_priority", [False, True])
@pytest.mark.parametrize("path", ["/generate", "/generate_stream"])
def test_a_refused_priority_is_listed_where_it_is_answered(path: str, public_priority: bool) -> None:
    """No API key is needed for the 403: without an admin key (or --allow_public_priority) it is the answer."""
    client = TestClient(create_app(FakeManager(), HttpServerOptions(auth=AuthPolicy(
        allow_public_priority=public_priority))))
    responses = client.get("/openapi.json").json()["paths"][path]["post"]["responses"]
    answer = client.post(path, json={"inputs": "hi", "high_priority_request": True})
    if public_priority:
        assert answer.status_code == 200 and "403" not in responses
        return
    assert answer.status_code == 403
    assert answer.json()["error"]["code"] == "priority_not_allowed"
    assert responses["403"]["content"]["application/json"]["schema"] == ERROR_REF
    assert "priority_not_allowed" in responses["403"]["description"]
    assert "403" not in client.get("/openapi.json").json()["paths"]["/v1/completions"]["post"]["responses"]


def test_a_keyed_server_marks_each_operation_its_key_guards(document: dict[str, Any], keyed_client: TestClient) -> None:
    assert document["components"]["securitySchemes"] == {"bearerAuth": {
        "type": "http", "scheme": "bearer", "description": document["components"]["securitySchemes"]["bearerAuth"][
            "description"]}}
    for path, operations in document["paths"].items():
        for method, operation in operations.items():
            if path in PROBE_PATHS:
                assert "security" not in operation, path
                continue
            assert operation["security"] == [{"bearerAuth": []}], path
            if method == "get" and "{" not in path:
                # The document's claim holds: the path answers 401 without the key.
                assert keyed_client.get(path).status_code == 401, path


def test_an_open_server_declares_no_key() -> None:
    document = TestClient(create_app(FakeManager(), HttpServerOptions())).get("/openapi.json").json()
    assert "securitySchemes" not in document["components"]
    assert not any("security" in operation for operations in document["paths"].values()
                   for operation in operations.values())


def test_a_cluster_key_guards_the_pd_paths_alone() -> None:
    router = APIRouter()
    router.add_api_route("/pd/nodes", lambda: {"ready": []}, methods=["GET"])
    client = TestClient(create_app(FakeManager(), HttpServerOptions(auth=AuthPolicy(cluster_key="c")), [router]))
    document = client.get("/openapi.json").json()
    assert set(document["components"]["securitySchemes"]) == {"pdClusterKey"}
    assert document["paths"]["/pd/nodes"]["get"]["security"] == [{"pdClusterKey": []}]
    assert "security" not in document["paths"]["/v1/models"]["get"]
    assert client.get("/pd/nodes").status_code == 401
    assert client.get("/pd/nodes", headers={"Authorization": "Bearer c"}).status_code == 200


def test_401_is_listed_exactly_where_a_key_is_asked_for(document: dict[str, Any]) -> None:
    for path, operations in document["paths"].items():
        for method, operation in operations.items():
            assert ("401" in operation["responses"]) is bool(operation.get("security")), (path, method)
