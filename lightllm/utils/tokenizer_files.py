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

from lightllm.utils.tokenizer_file_checks import sentencepiece_pieces


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
    """The id of ``text`` in the vocabulary file transformers reads without a ``tokenizer.json``.

    Only when the directory holds one vocabulary file (a BPE ``vocab.json``, a WordPiece
    ``vocab.txt``, a SentencePiece ``*.model``), which is then the one its tokenizer class reads:
    with several, the class decides which, and a guess could make generation stop at an ordinary
    token (the HTTP process then warns that the tokenizer's ``eos_token`` is not among the ids).
    A legacy ``added_tokens.json`` comes first. tiktoken rank files hold no special tokens (those
    are added tokens), so they give none.
    """
    added = _read_json(model_dir / "added_tokens.json") or {}
    if isinstance(added.get(text), int):
        return added[text]
    candidates = [path for path in (model_dir / "vocab.json", model_dir / "vocab.txt") if path.is_file()]
    candidates += sorted(path for path in model_dir.glob("*.model") if path.is_file())
    if len(candidates) != 1:
        return None
    path = candidates[0]
    if path.name == "vocab.json":
        table = _read_json(path) or {}
        return table[text] if isinstance(table.get(text), int) else None
    if path.name == "vocab.txt":
        try:
            lines = path.read_text(encoding="utf-8").split("\n")
        except (OSError, UnicodeDecodeError):
            return None
        # transformers' WordPiece vocabulary keeps the last line of a token listed twice.
        return len(lines) - 1 - lines[::-1].index(text) if text in lines else None
    try:
        pieces = sentencepiece_pieces(path.read_bytes()) or []
    except OSError:
        return None
    return pieces.index(text) if text in pieces else None


def tokenizer_eos_token_text(model_dir: str | Path) -> Optional[str]:
    """The tokenizer's ``eos_token`` text as transformers' ``from_pretrained`` settles it (None: none).

    transformers (5.x, ``PreTrainedTokenizerBase._from_pretrained``) reads ``special_tokens_map.json``
    only when ``tokenizer_config.json`` has no ``added_tokens_decoder`` (a file saved before those
    existed), and then every key the map has replaces the config's, null included; with an
    ``added_tokens_decoder`` the map is not read at all.  The two files often disagree (a chat
    fine-tune edits one), so the order decides where generation stops.
    """
    directory = Path(model_dir)
    config = _read_json(directory / "tokenizer_config.json") or {}
    if "added_tokens_decoder" not in config:
        special = _read_json(directory / "special_tokens_map.json") or {}
        if "eos_token" in special:
            return _token_text(special["eos_token"])
    return _token_text(config.get("eos_token"))


def tokenizer_eos_token_id(model_dir: str | Path) -> Optional[int]:
    """The id of the tokenizer's ``eos_token`` (None when the files name none or it cannot be resolved)."""
    text = tokenizer_eos_token_text(model_dir)
    return None if text is None else _token_id(Path(model_dir), text)
