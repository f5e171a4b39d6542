"""Unit-test fixtures: the HTTP app around a scripted request manager, and a small trained
tokenizer for the benchmark client tests."""

from __future__ import annotations

from pathlib import Path

import pytest
from fastapi.testclient import TestClient
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers
from transformers import AutoTokenizer, PreTrainedTokenizerFast

from api_fakes import FakeManager
from lightllm.benchmark.prompts import PromptBuilder
from lightllm.server.http.app import create_app


@pytest.fixture()
def manager() -> FakeManager:
    return FakeManager()


@pytest.fixture()
def client(manager: FakeManager) -> TestClient:
    return TestClient(create_app(manager), raise_server_exceptions=False)


@pytest.fixture(scope="session")
def tokenizer_dir(tmp_path_factory) -> Path:
    """A byte-level BPE tokenizer trained here, with a BOS post-processor like Llama's."""
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=400, special_tokens=["<s>", "</s>"], initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    corpus = [f"the quick brown fox {i} jumps over the lazy dog; 你好世界 ünïcödé" for i in range(200)]
    tok.train_from_iterator(corpus, trainer)
    bos = [("<s>", tok.token_to_id("<s>"))]
    tok.post_processor = processors.TemplateProcessing(single="<s> $A", special_tokens=bos)
    path = tmp_path_factory.mktemp("tokenizer")
    PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<s>", eos_token="</s>").save_pretrained(path)
    return path


@pytest.fixture(scope="session")
def tokenizer(tokenizer_dir):
    return AutoTokenizer.from_pretrained(tokenizer_dir)


@pytest.fixture(scope="session")
def builder(tokenizer) -> PromptBuilder:
    return PromptBuilder(tokenizer)
