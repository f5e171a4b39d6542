"""Tokenizer files that cannot be parsed are refused at start in one line naming the file; the ones
transformers reads are accepted (checked against transformers on a trained SentencePiece model).

Before: an empty ``tokenizer.model`` was served as a three-token vocabulary (every chat one
``<unk>``, answered 200), a Git LFS pointer failed after the weights loaded, and a
``tokenizer.json`` or ``tokenizer_config.json`` of the wrong shape ended the launcher in a traceback.
"""

from __future__ import annotations

import base64
import json
import shutil
from pathlib import Path

import pytest
import sentencepiece
from transformers import LlamaTokenizer

from checkpoint_damage_support import copy_checkpoint, remove_tokenizer
from lightllm.common.basemodel.model_config import ModelConfig
from lightllm.utils.tokenizer_file_checks import check_tokenizer_files_readable
from lightllm.utils.tokenizer_files import tokenizer_eos_token_id
from lightllm.utils.tokenizer_sources import TokenizerFilesError

_LFS_POINTER = ("version https://git-lfs.github.com/spec/v1\noid sha256:4d2a8e1f0c9b3a7d6e5f4c3b2a190817263544332211"
                "00ffeeddccbbaa99887766\nsize 499723\n")


@pytest.fixture(scope="module")
def sentencepiece_model(tmp_path_factory: pytest.TempPathFactory) -> bytes:
    """A small SentencePiece BPE model, trained here, as a Llama-2 / Mistral checkpoint ships it."""
    directory = tmp_path_factory.mktemp("spm")
    corpus = directory / "corpus.txt"
    corpus.write_text("\n".join(f"the quick brown fox {i} jumps over the lazy dog number {i * 7}" for i in range(200)))
    sentencepiece.SentencePieceTrainer.train(input=str(corpus), model_prefix=str(directory / "m"), vocab_size=320,
                                             model_type="bpe", byte_fallback=True, minloglevel=2)
    return (directory / "m.model").read_bytes()


def _sentencepiece_only(tiny_llama_dir: Path, tmp_path: Path, model: bytes, name: str = "sp_only") -> Path:
    model_dir = copy_checkpoint(tiny_llama_dir, tmp_path / name)
    remove_tokenizer(model_dir)
    (model_dir / "tokenizer.model").write_bytes(model)
    return model_dir


def test_a_trained_sentencepiece_model_is_accepted_and_transformers_reads_it(tiny_llama_dir, tmp_path,
                                                                            sentencepiece_model):
    model_dir = _sentencepiece_only(tiny_llama_dir, tmp_path, sentencepiece_model)
    check_tokenizer_files_readable(model_dir)
    assert len(LlamaTokenizer.from_pretrained(str(model_dir)).get_vocab()) == 320


def test_a_tiktoken_rank_file_is_accepted(tiny_llama_dir, tmp_path):
    ranks = "".join(f"{base64.b64encode(bytes([byte])).decode()} {byte}\n" for byte in range(256))
    for name in ("tokenizer.model", "o200k.tiktoken"):
        model_dir = copy_checkpoint(tiny_llama_dir, tmp_path / name)
        remove_tokenizer(model_dir)
        (model_dir / name).write_text(ranks)
        check_tokenizer_files_readable(model_dir)


def test_a_tiktoken_file_cut_short_inside_a_line_is_refused(tiny_llama_dir, tmp_path):
    """Only the first lines were looked at: a download cut off at the end passed, and tiktoken's loader failed late."""
    ranks = "".join(f"{base64.b64encode(bytes([byte])).decode()} {byte}\n" for byte in range(256))
    model_dir = _sentencepiece_only(tiny_llama_dir, tmp_path, (ranks + "SGVsbG8").encode())
    with pytest.raises(TokenizerFilesError, match="is neither a SentencePiece model nor a tiktoken rank file"):
        check_tokenizer_files_readable(model_dir)


def test_a_serialization_that_is_a_git_lfs_pointer_says_so(tiny_llama_dir, tmp_path):
    model_dir = copy_checkpoint(tiny_llama_dir, tmp_path / "lfs_json")
    (model_dir / "tokenizer.json").write_text(_LFS_POINTER)
    with pytest.raises(TokenizerFilesError, match=r"tokenizer.json is a Git LFS pointer, not the file it points to; "
                                                  r"fetch it \(git lfs pull\)"):
        check_tokenizer_files_readable(model_dir)


def test_a_model_file_no_tokenizer_class_reads_is_left_alone(tiny_llama_dir, tmp_path, sentencepiece_model):
    model_dir = _sentencepiece_only(tiny_llama_dir, tmp_path, sentencepiece_model)
    (model_dir / "tokenizer.model.v1").write_bytes(b"")  # an older copy beside the one in use
    (model_dir / "reward.model").write_bytes(b"\x00\x01")
    check_tokenizer_files_readable(model_dir)


@pytest.mark.parametrize("content, message", [
    (b"", "tokenizer.model is empty; copy the model's tokenizer files into the directory again"),
    (b"\n \n", "tokenizer.model is empty"),
    (_LFS_POINTER.encode(), "tokenizer.model is a Git LFS pointer, not the file it points to; fetch it (git lfs pull)"),
    (bytes(range(256)) * 2, "tokenizer.model is neither a SentencePiece model nor a tiktoken rank file"),
])
def test_a_damaged_vocabulary_model_is_refused_naming_it(tiny_llama_dir, tmp_path, content, message):
    model_dir = _sentencepiece_only(tiny_llama_dir, tmp_path, content)
    with pytest.raises(TokenizerFilesError) as refused:
        check_tokenizer_files_readable(model_dir)
    assert str(refused.value).startswith(f"{model_dir / 'tokenizer.model'}") and message in str(refused.value)
    assert "\n" not in str(refused.value)


def test_a_damaged_model_beside_a_good_serialization_matters_only_to_a_slow_load(tiny_llama_dir, tmp_path):
    model_dir = copy_checkpoint(tiny_llama_dir, tmp_path / "both")
    (model_dir / "tokenizer.model").write_text(_LFS_POINTER)
    check_tokenizer_files_readable(model_dir)  # a fast load reads tokenizer.json only
    with pytest.raises(TokenizerFilesError, match="is a Git LFS pointer"):
        check_tokenizer_files_readable(model_dir, "slow")


@pytest.mark.parametrize("file_name, content, message", [
    ("tokenizer.json", {"model": 5}, "tokenizer.json cannot be read as a tokenizer ("),
    ("tokenizer_config.json", {"added_tokens_decoder": [{"content": "<|eot_id|>"}]},
     "tokenizer_config.json: added_tokens_decoder must be an object mapping token ids to tokens, got list"),
    ("tokenizer_config.json", {"added_tokens_decoder": {"7": "<|eot_id|>"}},
     "tokenizer_config.json: added_tokens_decoder entry '7' must map a token id to an object with a string 'content'"),
    ("tokenizer_config.json", {"added_tokens_decoder": {"x": {"content": "a"}}}, "added_tokens_decoder entry 'x'"),
])
def test_tokenizer_files_of_the_wrong_shape_are_refused_not_a_traceback(tiny_llama_dir, tmp_path, file_name, content,
                                                                        message):
    model_dir = copy_checkpoint(tiny_llama_dir, tmp_path / "shape")
    config = json.loads((model_dir / "tokenizer_config.json").read_text()) if file_name != "tokenizer.json" else {}
    (model_dir / file_name).write_text(json.dumps({**config, **content, "eos_token": "</s>"}))
    # The eos lookup the launcher makes first (reading the config) resolves nothing instead of raising.
    ModelConfig.from_dir(str(model_dir))
    tokenizer_eos_token_id(model_dir)
    with pytest.raises(TokenizerFilesError) as refused:
        check_tokenizer_files_readable(model_dir)
    assert message in str(refused.value), refused.value


def test_the_launcher_refuses_an_empty_sentencepiece_model_in_one_line(tiny_llama_dir, tmp_path):
    import subprocess
    import sys

    model_dir = _sentencepiece_only(tiny_llama_dir, tmp_path, b"")
    done = subprocess.run([sys.executable, "-m", "lightllm.server.api_server", "--model_dir", str(model_dir),
                           "--port", "18647", "--device", "cpu"], capture_output=True, text=True, timeout=120)
    lines = [line for line in done.stderr.splitlines() if " INFO " not in line]
    assert done.returncode == 2 and lines == [f"error: {model_dir / 'tokenizer.model'} is empty; copy the model's "
                                              "tokenizer files into the directory again"], done.stderr
    shutil.rmtree(model_dir)
