"""create_app depends on the RequestManager protocol and refuses what does not implement it."""

from __future__ import annotations

import pytest

from api_fakes import FakeManager
from lightllm.server.http.app import create_app
from lightllm.server.request_manager import RequestManager, missing_request_manager_members


def test_the_test_double_implements_the_protocol() -> None:
    manager = FakeManager()
    assert missing_request_manager_members(manager) == []
    assert isinstance(manager, RequestManager)


def test_create_app_names_what_an_incomplete_manager_lacks() -> None:
    class Partial(FakeManager):
        pass

    partial = Partial()
    del partial.served.served_model_names
    with pytest.raises(TypeError, match="Partial lacks served.served_model_names"):
        create_app(partial)
    with pytest.raises(TypeError, match="object lacks check_admission, generate, generation_caps_source, health"):
        create_app(object())
