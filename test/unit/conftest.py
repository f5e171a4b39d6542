"""Fixtures of the HTTP-surface unit tests: the real app around a scripted request manager."""

from __future__ import annotations

import pytest
from fastapi.testclient import TestClient

from api_fakes import FakeManager
from lightllm.server.api_http import create_app


@pytest.fixture()
def manager() -> FakeManager:
    return FakeManager()


@pytest.fixture()
def client(manager: FakeManager) -> TestClient:
    return TestClient(create_app(manager), raise_server_exceptions=False)
