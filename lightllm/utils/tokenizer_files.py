"""Facts read straight from a checkpoint's tokenizer files, without loading transformers.

The launcher decides the end-of-sequence ids before any process starts (the ranks, the
detokenizer and the HTTP process all need them), and loading a tokenizer there would put
transformers into a process that otherwise never imports it.  The HTTP process, which loads the
real tokenizer, checks the answer (:meth:`lightllm.server.served_model.ServedModel.check_eos_ids`).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any, Dict, Optional

from lightllm.utils.tokenizer_file_checks import sentencepiece_pieces, tiktoken_rank


def _read_json(path: Path) -> Optional[Dict[str, Any]]:
    if not path.is_file():
        return None
    try:
        value = json.loads(path.read_text())
    except (OSError, UnicodeDecodeError, json.JSONDecodeError):
        return None
    return value if isinstance(value, dict) else None


def _token_text(value: Any) -> Optional[str]:
    # A special token is written as its text or as an AddedToken dict ({"content": ...}).
    if isinstance(value, str):
        return value or None
    if isinstance(value, dict) and isinstance(value.get("content"), str):
        return value["content"] or None
    return None


def _token_id(model_dir: Path, text: str) -> Optional[int]:
    """The id of token ``text`` from the tokenizer files (added tokens first, then the model's vocabulary)."""
    # Files of the wrong shape resolve nothing here: the launcher's file check refuses them by name.
    config = _read_json(model_dir / "tokenizer_config.json") or {}
    decoder = config.get("added_tokens_decoder")
    for key, entry in (decoder.items() if isinstance(decoder, dict) else ()):
        if _token_text(entry) == text and str(key).isdigit():
            return int(key)
    if not (model_dir / "tokenizer.json").is_file():
        # Then transformers builds the tokenizer from a vocabulary file of its class.
        return _vocabulary_file_id(model_dir, text)
    tokenizer = _read_json(model_dir / "tokenizer.json") or {}
    added = tokenizer.get("added_tokens")
    for entry in (added if isinstance(added, list) else ()):
        if isinstance(entry, dict) and entry.get("content") == text and isinstance(entry.get("id"), int):
            return entry["id"]
    model = tokenizer.get("model")
    vocab = model.get("vocab") if isinstance(model, dict) else None
    if isinstance(vocab, dict) and isinstance(vocab.get(text), int):
        return vocab[text]
    if isinstance(vocab, list):
        # Unigram: a list of [piece, score] whose index is the id.
        for index, entry in enumerate(vocab):
            if isinstance(entry, list) and entry and entry[0] == text:
                return index
    return None


def _vocabulary_file_id(model_dir: Path, text: str) -> Optional[int]:
    """The id of ``text`` in the vocabulary files transformers reads without a ``tokenizer.json``.

    Legacy ``added_tokens.json`` first, then a BPE ``vocab.json``, a WordPiece ``vocab.txt`` (the
    line number) and a SentencePiece or tiktoken ``*.model`` / ``*.tiktoken`` (the piece's index,
    the token's rank): a ChatML ``<|im_end|>`` kept in ``tokenizer.model`` only is an id too.
    """
    for name in ("added_tokens.json", "vocab.json"):
        table = _read_json(model_dir / name) or {}
        if isinstance(table.get(text), int):
            return table[text]
    vocab_txt = model_dir / "vocab.txt"
    if vocab_txt.is_file():
        try:
            lines = vocab_txt.read_text(encoding="utf-8").split("\n")
        except (OSError, UnicodeDecodeError):
            lines = []
        if text in lines:
            return lines.index(text)
    for path in sorted(model_dir.glob("*.model")) + sorted(model_dir.glob("*.tiktoken")):
        try:
            data = path.read_bytes()
        except OSError:
            continue
        rank = tiktoken_rank(data, text.encode("utf-8"))
        if rank is not None:
            return rank
        pieces = sentencepiece_pieces(data) or []
        if text in pieces:
            return pieces.index(text)
    return None


def tokenizer_eos_token_id(model_dir: str | Path) -> Optional[int]:
    """The id of the tokenizer's ``eos_token`` (None when the files name none or it cannot be resolved)."""
    directory = Path(model_dir)
    text = None
    for name in ("tokenizer_config.json", "special_tokens_map.json"):
        text = _token_text((_read_json(directory / name) or {}).get("eos_token"))
        if text is not None:
            break
    return None if text is None else _token_id(directory, text)
