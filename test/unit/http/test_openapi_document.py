"""The generated /openapi.json states what the probes and /metrics really answer.

Health probes need no API key (so no 401) and say "not ready" or "stalled" with a 503 carrying the
error body; /metrics is served as Prometheus text, not JSON. Each claim is checked against the
document and against the live answer of the same app.
"""

from __future__ import annotations

from typing import Any

import pytest
from fastapi.testclient import TestClient

from api_fakes import FakeManager
from lightllm.server.http.app import create_app
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
