"""A checkpoint directory without tokenizer files is refused in one line naming it and what was looked
for; every file set transformers builds a real tokenizer from is accepted (checked against transformers)."""

from __future__ import annotations

import json
import logging
import shutil
from pathlib import Path
from typing import Dict, Optional, Sequence

import pytest
from transformers import AutoTokenizer

from checkpoint_damage_support import TOKENIZER_FILES, copy_checkpoint, remove_tokenizer
from lightllm.utils.tokenizer_sources import TokenizerFilesError, check_tokenizer_sources, tokenizer_sources
from lightllm.utils.tokenizer_utils import load_tokenizer


def _checkpoint(source: Path, destination: Path, keep: Sequence[str] = (),
                extra: Optional[Dict[str, str]] = None) -> Path:
    """``source``'s config.json, the tokenizer files of ``keep`` and the files of ``extra`` (name -> text)."""
    destination.mkdir()
    for name in ("config.json", *keep):
        shutil.copy(source / name, destination / name)
    for name, text in (extra or {}).items():
        (destination / name).write_text(text)
    return destination


def _bpe_files(source: Path) -> Dict[str, str]:
    """The byte-level BPE of ``source``'s tokenizer.json as the vocab.json and merges.txt of a slow tokenizer."""
    model = json.loads((source / "tokenizer.json").read_text())["model"]
    merges = [merge if isinstance(merge, str) else " ".join(merge) for merge in model["merges"]]
    return {"vocab.json": json.dumps(model["vocab"]), "merges.txt": "#version: 0.2\n" + "\n".join(merges) + "\n"}


def _transformers_tokenizer(model_dir: Path):
    """What transformers builds from ``model_dir`` (None when it fails)."""
    logging.disable(logging.WARNING)
    try:
        return AutoTokenizer.from_pretrained(str(model_dir), local_files_only=True, trust_remote_code=False)
    except Exception:
        return None
    finally:
        logging.disable(logging.NOTSET)


def test_a_directory_without_tokenizer_files_is_refused_naming_it(tiny_llama_dir: Path, tmp_path: Path) -> None:
    model_dir = copy_checkpoint(tiny_llama_dir, tmp_path / "no_tokenizer")
    remove_tokenizer(model_dir)
    assert tokenizer_sources(model_dir) == []
    with pytest.raises(TokenizerFilesError) as refused:
        check_tokenizer_sources(model_dir)
    text = str(refused.value)
    assert text == (f"no tokenizer files in {model_dir}: looked for tokenizer.json, or a vocabulary (tokenizer.model "
                    f"or another SentencePiece/tiktoken *.model, tekken.json, *.tiktoken, vocab.json with merges.txt, "
                    f"vocab.txt); copy the model's tokenizer files into the directory")
    # transformers fails on it too, in several lines naming no file.
    assert _transformers_tokenizer(model_dir) is None
    # Callers loading the tokenizer directly get the same line.
    with pytest.raises(TokenizerFilesError, match="^no tokenizer files in "):
        load_tokenizer(str(model_dir))


def test_configuration_files_alone_are_named_as_such(tiny_llama_dir: Path, tmp_path: Path) -> None:
    model_dir = _checkpoint(tiny_llama_dir, tmp_path / "config_only", keep=TOKENIZER_FILES[1:])
    with pytest.raises(TokenizerFilesError, match=r"vocab\.txt\), and its tokenizer_config\.json and "
                                                  r"special_tokens_map\.json only configure one; copy"):
        check_tokenizer_sources(model_dir)
    assert _transformers_tokenizer(model_dir) is None


def test_a_qwen2_directory_without_files_is_refused_though_transformers_may_build_an_empty_tokenizer(
        tiny_qwen2_dir: Path, tmp_path: Path) -> None:
    model_dir = _checkpoint(tiny_qwen2_dir, tmp_path / "qwen2_none", keep=["tokenizer_config.json"])
    with pytest.raises(TokenizerFilesError):
        check_tokenizer_sources(model_dir)
    # transformers 5.x builds Qwen2's tokenizer with an empty vocabulary here (4.x fails): no text has tokens.
    built = _transformers_tokenizer(model_dir)
    assert built is None or built.encode("hello world", add_special_tokens=False) == []


@pytest.mark.parametrize("case", ["tokenizer_json_only", "tokenizer_json_and_config", "vocab_and_merges",
                                  "vocab_merges_and_config"])
def test_file_sets_transformers_builds_a_tokenizer_from_are_accepted(tiny_qwen2_dir: Path, tmp_path: Path,
                                                                      case: str) -> None:
    model_dir = {
        "tokenizer_json_only": lambda d: _checkpoint(tiny_qwen2_dir, d, keep=["tokenizer.json"]),
        "tokenizer_json_and_config": lambda d: _checkpoint(tiny_qwen2_dir, d, keep=TOKENIZER_FILES),
        "vocab_and_merges": lambda d: _checkpoint(tiny_qwen2_dir, d, extra=_bpe_files(tiny_qwen2_dir)),
        "vocab_merges_and_config": lambda d: _checkpoint(tiny_qwen2_dir, d, keep=["tokenizer_config.json"],
                                                         extra=_bpe_files(tiny_qwen2_dir)),
    }[case](tmp_path / case)
    assert tokenizer_sources(model_dir)
    check_tokenizer_sources(model_dir)
    built = _transformers_tokenizer(model_dir)
    assert built is not None and built.encode("hello world", add_special_tokens=False) != []


def test_a_byte_level_tokenizer_class_needs_no_vocabulary_file(tiny_llama_dir: Path, tmp_path: Path) -> None:
    model_dir = _checkpoint(tiny_llama_dir, tmp_path / "byt5", extra={
        "tokenizer_config.json": json.dumps({"tokenizer_class": "ByT5Tokenizer"})})
    assert tokenizer_sources(model_dir) == ["tokenizer_config.json"]
    built = _transformers_tokenizer(model_dir)
    assert type(built).__name__ == "ByT5Tokenizer" and built.encode("hi", add_special_tokens=False) != []


@pytest.mark.parametrize("name", ["tokenizer.model", "spiece.model", "tokenizer.model.v3", "tekken.json",
                                  "qwen.tiktoken", "vocab.txt"])
def test_each_kind_of_vocabulary_file_counts(tmp_path: Path, name: str) -> None:
    (tmp_path / name).write_text("")
    assert tokenizer_sources(tmp_path) == [name]


def test_a_serialization_named_by_the_tokenizer_config_counts(tmp_path: Path) -> None:
    (tmp_path / "tokenizer_config.json").write_text(json.dumps({"fast_tokenizer_files": ["tokenizer.4.0.json"]}))
    (tmp_path / "tokenizer.4.0.json").write_text("{}")
    assert tokenizer_sources(tmp_path) == ["tokenizer.4.0.json"]
