"""A checkpoint whose only tokenizer is a SentencePiece ``tokenizer.model`` needs packages that
transformers only names in a warning: loading it without them says which, in one line."""

from __future__ import annotations

import json

import pytest

from lightllm.utils import tokenizer_utils
from lightllm.utils.tokenizer_utils import load_tokenizer


def _model_only_dir(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "llama"}))
    (tmp_path / "tokenizer_config.json").write_text(json.dumps({"tokenizer_class": "LlamaTokenizer"}))
    (tmp_path / "tokenizer.model").write_bytes(b"\x0e\x00not a sentencepiece model")
    return tmp_path


def test_missing_sentencepiece_packages_are_named(tmp_path, monkeypatch):
    model_dir = _model_only_dir(tmp_path)
    monkeypatch.setattr(tokenizer_utils, "_importable", lambda module: module != "google.protobuf")
    with pytest.raises(ValueError) as refused:
        load_tokenizer(str(model_dir))
    message = str(refused.value)
    assert "has only a SentencePiece tokenizer.model" in message and "the protobuf package(s): install them" in message
    assert "\n" not in message


def test_with_the_packages_present_the_loaders_own_error_stands(tmp_path, monkeypatch):
    model_dir = _model_only_dir(tmp_path)
    monkeypatch.setattr(tokenizer_utils, "_importable", lambda module: True)
    with pytest.raises(Exception) as failed:
        load_tokenizer(str(model_dir))
    assert "has only a SentencePiece tokenizer.model" not in str(failed.value)


def test_a_checkpoint_with_tokenizer_json_needs_nothing_more(tiny_llama_dir):
    assert tokenizer_utils.sentencepiece_packages_missing(str(tiny_llama_dir)) == []
    assert load_tokenizer(str(tiny_llama_dir)) is not None
