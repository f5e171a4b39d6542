"""Servers shared by the integration tests of one module."""

from __future__ import annotations

import pytest

from server_process import start_server


@pytest.fixture(scope="module")
def tiny_server(tiny_llama_dir, tmp_path_factory):
    """A normal-mode server on the tiny Llama demo model."""
    handle = start_server(tiny_llama_dir, tmp_path_factory.mktemp("logs"), ["--max_total_token_num", "16384"])
    yield handle
    handle.stop()
