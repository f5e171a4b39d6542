"""The internal request fields (``infer_high_priority``, ``segment_index``, ``request_id``) cannot
be set from any public API field.

The app is the real ``create_app``; the manager behind it records every keyword a handler
passes to ``generate`` and the internal groups of every ``RequestSpec`` it gets, so a field that
leaked through a free-form part of a body would show up there.  The internal path (the manager's
own arguments) is covered in test_internal_request_path.py.
"""

from __future__ import annotations

from typing import Any

import pytest
from fastapi.testclient import TestClient

from api_fakes import MODEL, FakeManager, assert_error
from lightllm.server.core.objs.request_spec import PdPlacement, Segment
from lightllm.server.http.app import create_app

INTERNAL = {"infer_high_priority": -7, "segment_index": 3, "request_id": 12345}
DEFAULT_INTERNAL = (0, Segment(), PdPlacement())

ENDPOINTS = {
    "/generate": {"inputs": "hi", "parameters": {"max_new_tokens": 2}},
    "/generate_stream": {"inputs": "hi", "parameters": {"max_new_tokens": 2}},
    "/v1/completions": {"model": MODEL, "prompt": "hi", "max_tokens": 2},
    "/v1/chat/completions": {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2},
}


class RecordingManager(FakeManager):
    """FakeManager that also accepts and records any extra keyword a handler passes."""

    def __init__(self) -> None:
        super().__init__()
        self.extra_keywords: list[dict[str, Any]] = []
        self.internal: list[tuple[Any, ...]] = []

    def generate(self, spec, *, request=None, **extra):  # type: ignore[override]
        self.extra_keywords.append(extra)
        # The spec's internal groups keep their defaults: no public field reaches them.
        self.internal.append((spec.priority.infer_high_priority, spec.segment, spec.pd))
        return super().generate(spec, request=request)


@pytest.fixture()
def recording() -> RecordingManager:
    return RecordingManager()


@pytest.fixture()
def app_client(recording: RecordingManager) -> TestClient:
    return TestClient(create_app(recording), raise_server_exceptions=False)


def _cases() -> list[tuple[str, dict[str, Any], str]]:
    cases = []
    for path, body in ENDPOINTS.items():
        for name, value in INTERNAL.items():
            cases.append((path, {**body, name: value}, name))
            if "parameters" in body:
                cases.append((path, {**body, "parameters": {**body["parameters"], name: value}}, f"parameters.{name}"))
    return cases


@pytest.mark.parametrize(("path", "body", "param"), _cases())
def test_internal_fields_are_refused_as_unknown_parameters(app_client, recording, path, body, param) -> None:
    assert_error(app_client.post(path, json=body), 400, param)
    assert recording.calls == []


@pytest.mark.parametrize(
    ("path", "extra"),
    [
        ("/v1/completions", {"metadata": dict(INTERNAL)}),
        ("/v1/chat/completions", {"metadata": dict(INTERNAL)}),
        ("/v1/chat/completions", {"chat_template_kwargs": dict(INTERNAL)}),
        ("/v1/completions", {"stream": True, "stream_options": {"include_usage": True, **INTERNAL}}),
        ("/generate", {"multimodal_params": dict(INTERNAL)}),
    ],
)
def test_free_form_parts_of_a_body_never_reach_the_internal_arguments(app_client, recording, path, extra) -> None:
    """Where a body may carry arbitrary keys, they are refused or stay out of ``generate``."""
    body = {**ENDPOINTS[path], **extra}
    response = app_client.post(path, json=body)
    assert response.status_code in (200, 400), response.text
    assert all(keywords == {} for keywords in recording.extra_keywords)
    assert all(internal == DEFAULT_INTERNAL for internal in recording.internal)
    if response.status_code == 200:
        assert recording.calls, "an accepted request reaches the manager"


def test_ordinary_requests_pass_no_internal_arguments(app_client, recording) -> None:
    for path, body in ENDPOINTS.items():
        assert app_client.post(path, json=body).status_code == 200
    assert len(recording.extra_keywords) == len(ENDPOINTS)
    assert all(keywords == {} for keywords in recording.extra_keywords)
    assert recording.internal == [DEFAULT_INTERNAL] * len(ENDPOINTS)
