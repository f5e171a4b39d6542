"""Fixtures shared by the compatibility tests: one server and one transformers reference for the whole package.

``tiny_server`` overrides the module-scoped one of ``test/integration/conftest.py`` with package
scope, so splitting the tests into files by concept does not start more servers.
"""

from __future__ import annotations

import openai
import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from server_process import start_server


@pytest.fixture(scope="package")
def tiny_server(tiny_llama_dir, tmp_path_factory):
    """A normal-mode server on the tiny Llama demo model, shared by every test of the package (it accepts a
    request's own chat_template, which the package's template tests send)."""
    handle = start_server(tiny_llama_dir, tmp_path_factory.mktemp("logs"),
                          ["--max_total_token_num", "16384", "--trust_request_chat_template"])
    yield handle
    handle.stop()


@pytest.fixture(scope="package")
def hf_model(tiny_llama_dir):
    """The same checkpoint in transformers (float32), the source of reference logprobs."""
    return AutoModelForCausalLM.from_pretrained(str(tiny_llama_dir), dtype=torch.float32).eval()


@pytest.fixture(scope="package")
def tokenizer(tiny_llama_dir):
    """The checkpoint's tokenizer."""
    return AutoTokenizer.from_pretrained(str(tiny_llama_dir))


@pytest.fixture(scope="package")
def client(tiny_server):
    """The official OpenAI client pointed at the shared server."""
    return openai.OpenAI(base_url=f"{tiny_server.url}/v1", api_key="unused")
