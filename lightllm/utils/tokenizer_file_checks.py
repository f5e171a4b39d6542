"""Whether a checkpoint's tokenizer files can be parsed, checked once at start without transformers.

The HTTP and detokenization processes load the tokenizer only after every process started (and
after the ranks loaded the weights), and transformers' failures there name no file, or do not
fail at all: a download cut short left a ``tokenizer.json`` that failed as ``detokenization:
KeyError: 'added_tokens'``; an empty ``tokenizer.model`` was served as a vocabulary of three
tokens that turned every chat into one ``<unk>``; a Git LFS pointer in its place failed as
transformers' tiktoken fallback's parse error.  So the launcher and the PD master parse each file
transformers would read here, in milliseconds and without torch, and refuse the first that cannot
be parsed in one line naming it.
"""

from __future__ import annotations

import fnmatch
import json
import re
from pathlib import Path
from typing import Any, List, Optional

from lightllm.utils.tokenizer_sources import (
    TOKENIZER_CONFIG,
    VOCABULARY_NAMES,
    TokenizerFilesError,
    tokenizer_sources,
)

# The vocabulary models transformers' tokenizer classes read (their vocab_files_names): SentencePiece
# protobufs or tiktoken rank files.  Other *.model files (an old tokenizer.model.v1) are left alone.
VOCABULARY_MODEL_NAMES = ("tokenizer.model", "spiece.model", "sentencepiece.bpe.model", "sentencepiece.model",
                          "tiktoken.model")
VOCABULARY_MODEL_PATTERNS = ("*.tiktoken",)
_LFS_POINTER = b"version https://git-lfs"
# One line of a tiktoken rank file: a base64 token, a space, its rank.
_TIKTOKEN_LINE = re.compile(rb"[A-Za-z0-9+/]*={0,2} \d+")
_AGAIN = "copy the model's tokenizer files into the directory again"


def check_tokenizer_files_readable(model_dir: str | Path, tokenizer_mode: str = "fast") -> None:
    """Raise :class:`~lightllm.utils.tokenizer_sources.TokenizerFilesError` naming the first tokenizer
    serialization, vocabulary model or configuration file of ``model_dir`` that cannot be parsed.

    A vocabulary model is checked only where transformers reads it: with no serialization
    (``tokenizer.json``) beside it, or under ``--tokenizer_mode slow``; a fast load never opens
    it, so a damaged copy next to a good ``tokenizer.json`` serves as before.
    """
    from tokenizers import Tokenizer

    directory = Path(model_dir)
    sources = tokenizer_sources(model_dir)
    serialized = [name for name in sources if name.endswith(".json") and name not in VOCABULARY_NAMES
                  and "tekken" not in name and name != TOKENIZER_CONFIG]
    for name in serialized:
        path = directory / name
        check_not_a_placeholder(path)
        try:
            Tokenizer.from_file(str(path))
        except Exception as exc:  # noqa: BLE001 - the library raises a bare Exception
            raise TokenizerFilesError(f"{path} cannot be read as a tokenizer ({str(exc).splitlines()[0][:200]}); "
                                      f"{_AGAIN}") from None
    if not serialized or tokenizer_mode == "slow":
        for name in sources:
            if name in VOCABULARY_MODEL_NAMES or any(fnmatch.fnmatchcase(name, p) for p in VOCABULARY_MODEL_PATTERNS):
                check_vocabulary_model(directory / name)
    for name in (TOKENIZER_CONFIG, "special_tokens_map.json"):
        path = directory / name
        if not path.is_file():
            continue
        try:
            value = json.loads(path.read_text(encoding="utf-8"))
        except (OSError, UnicodeDecodeError, ValueError) as exc:
            raise TokenizerFilesError(f"{path} is not valid JSON ({exc}); {_AGAIN}") from None
        if not isinstance(value, dict):
            raise TokenizerFilesError(f"{path} must hold a JSON object, got {type(value).__name__}")
        check_added_tokens_decoder(path, value.get("added_tokens_decoder"))


def check_not_a_placeholder(path: Path) -> bytes:
    """The bytes of ``path``; refuses an empty file and a Git LFS pointer (a clone without ``git lfs pull``)."""
    data = path.read_bytes()
    if not data.strip():
        raise TokenizerFilesError(f"{path} is empty; {_AGAIN}")
    if data.startswith(_LFS_POINTER):
        raise TokenizerFilesError(f"{path} is a Git LFS pointer, not the file it points to; fetch it "
                                  "(git lfs pull) or copy the model's tokenizer files into the directory again")
    return data


def check_vocabulary_model(path: Path) -> None:
    """Refuse a SentencePiece / tiktoken model file that is empty, a Git LFS pointer, or neither format."""
    data = check_not_a_placeholder(path)
    if _is_tiktoken_ranks(data):
        return
    if path.name.endswith(".tiktoken"):
        raise TokenizerFilesError(f"{path} is not a tiktoken rank file (lines of 'base64-token rank'); {_AGAIN}")
    pieces = _sentencepiece_piece_count(data)
    if pieces == 0:
        raise TokenizerFilesError(f"{path} is neither a SentencePiece model nor a tiktoken rank file; {_AGAIN}")


def check_added_tokens_decoder(path: Path, decoder: Any) -> None:
    """Refuse a ``tokenizer_config.json`` ``added_tokens_decoder`` that is not ``{"id": {"content": ...}}``.

    transformers reads it while loading (after every process started) and fails there with an
    ``AttributeError`` naming no file.
    """
    if decoder is None:
        return
    if not isinstance(decoder, dict):
        raise TokenizerFilesError(f"{path}: added_tokens_decoder must be an object mapping token ids to tokens, "
                                  f"got {type(decoder).__name__}")
    for key, entry in decoder.items():
        if not str(key).isdigit() or not isinstance(entry, dict) or not isinstance(entry.get("content"), str):
            raise TokenizerFilesError(f"{path}: added_tokens_decoder entry {key!r} must map a token id to an object "
                                      "with a string 'content'")


def _is_tiktoken_ranks(data: bytes) -> bool:
    """Whether every line of ``data`` is ``<base64 token> <integer rank>`` (a tiktoken rank file).

    Every line, not a prefix: a download cut short ends inside a line, which tiktoken's loader
    refuses (a few hundred thousand lines take milliseconds).
    """
    match = _TIKTOKEN_LINE.fullmatch
    lines = [line for line in data.splitlines() if line.strip()]
    return bool(lines) and all(match(line.strip()) for line in lines)


def _sentencepiece_piece_count(data: bytes) -> Optional[int]:
    """The pieces of a SentencePiece model protobuf (0: not one); None when protobuf cannot be imported."""
    pieces = sentencepiece_pieces(data)
    return None if pieces is None else len(pieces)


def sentencepiece_pieces(data: bytes) -> Optional[List[str]]:
    """The pieces of a SentencePiece model protobuf, in id order ([]: not one); None when protobuf
    cannot be imported.

    Parsed with the protobuf module sentencepiece ships, not the processor, which logs to stderr
    through absl when it fails.
    """
    try:
        from google.protobuf.message import DecodeError
        from sentencepiece import sentencepiece_model_pb2
    except Exception:  # noqa: BLE001 - missing (the launcher's own refusal), or protobuf's VersionError
        return None
    model = sentencepiece_model_pb2.ModelProto()
    try:
        model.ParseFromString(data)
    except DecodeError:
        return []
    return [piece.piece for piece in model.pieces]
