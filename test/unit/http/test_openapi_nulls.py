"""A null field gets the same verdict from /openapi.json as from the server.

The request models read ``"field": null`` as the field left out, and the document marks every
optional property nullable; a property whose extra schema put a type beside pydantic's own
``anyOf`` (``tools``: ``"type": "array"``) refused the null the server accepts, so a client that
validates its requests against the document could not send what the server takes. Every optional
property of every request body, top level and nested, is sent as null, to the app and to a JSON
Schema validator of the document.
"""

from __future__ import annotations

import copy
from typing import Any, Iterator

import pytest
from fastapi.testclient import TestClient

from api_fakes import FakeManager
from lightllm.server.http.app import create_app
from lightllm.server.http.server_options import HttpServerOptions

jsonschema = pytest.importorskip("jsonschema")

# A body each path accepts, and where in it a nested object with optional properties sits.
_BODIES: dict[str, dict[str, Any]] = {
    "/v1/completions": {"prompt": "x", "max_tokens": 2},
    "/v1/chat/completions": {"messages": [{"role": "user", "content": "x"}], "max_tokens": 2},
    "/generate": {"inputs": "x", "parameters": {"max_new_tokens": 2}},
    "/tokenize": {"prompt": "x"},
    "/tokenize#chat": {"messages": [{"role": "user", "content": "x"}]},
    "/detokenize": {"tokens": [1]},
}
_NESTED: dict[str, list[tuple[Any, ...]]] = {
    "/v1/chat/completions": [("messages", 0)],
    "/tokenize#chat": [("messages", 0)],
    "/generate": [("parameters",)],
}
# Null where the rule depends on another field, which the document states in words: a message's
# content may be null beside an assistant's tool_calls, not in a user's message.
_DEPENDS_ON_OTHER_FIELDS = {"messages.0.content"}


@pytest.fixture(scope="module")
def client() -> TestClient:
    return TestClient(create_app(FakeManager(), HttpServerOptions()), raise_server_exceptions=False)


@pytest.fixture(scope="module")
def document(client: TestClient) -> dict[str, Any]:
    return client.get("/openapi.json").json()


def _object_schema(document: dict[str, Any], schema: dict[str, Any], body: Any = None) -> dict[str, Any]:
    """The object schema (with ``properties``) behind ``$ref``s and an ``anyOf``: its first option
    that is no null and whose required properties ``body`` has (when given)."""
    if "$ref" in schema:
        return _object_schema(document, document["components"]["schemas"][schema["$ref"].rsplit("/", 1)[-1]], body)
    if "properties" not in schema:
        for option in schema.get("anyOf", ()):
            if option == {"type": "null"}:
                continue
            found = _object_schema(document, option, body)
            if body is None or set(found.get("required", ())) <= body.keys():
                return found
    return schema


def _path(case: str) -> str:
    return case.split("#")[0]


def _at(body: Any, where: tuple[Any, ...]) -> Any:
    for step in where:
        body = body[step]
    return body


def _body_schema(document: dict[str, Any], case: str) -> dict[str, Any]:
    return document["paths"][_path(case)]["post"]["requestBody"]["content"]["application/json"]["schema"]


def _nulled_bodies(case: str, document: dict[str, Any]) -> Iterator[tuple[str, dict[str, Any]]]:
    """(what was nulled, the body) for every optional property of the case's body and its nested objects."""
    base = _BODIES[case]
    top = _object_schema(document, _body_schema(document, case), base)
    places: list[tuple[tuple[Any, ...], dict[str, Any]]] = [((), top)]
    for where in _NESTED.get(case, ()):
        schema: dict[str, Any] = top
        for step in where:
            schema = schema["properties"][step] if isinstance(step, str) else schema["items"]
            schema = _object_schema(document, schema)
        places.append((where, schema))
    for where, schema in places:
        for name in schema["properties"]:
            if name in schema.get("required", ()):
                continue
            body = copy.deepcopy(base)
            _at(body, where)[name] = None
            yield ".".join(map(str, (*where, name))), body


@pytest.mark.parametrize("case", sorted(_BODIES))
def test_every_optional_null_gets_the_same_verdict_from_the_document_and_the_server(
        client: TestClient, document: dict[str, Any], case: str) -> None:
    path = _path(case)
    validator = jsonschema.Draft202012Validator({**document, **_body_schema(document, case)})
    assert client.post(path, json=_BODIES[case]).status_code == 200
    checked = 0
    disagreements = []
    for nulled, body in _nulled_bodies(case, document):
        if nulled in _DEPENDS_ON_OTHER_FIELDS:
            continue
        status = client.post(path, json=body).status_code
        if (status == 200) != validator.is_valid(body):
            disagreements.append((nulled, status))
        checked += 1
    assert checked >= 1 and not disagreements, disagreements
