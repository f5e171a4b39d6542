"""Whether a checkpoint directory holds files a tokenizer can be built from, decided without transformers.

Transformers' ``AutoTokenizer`` (4.x and 5.x) builds a tokenizer from a ``tokenizer.json``
serialization (or the one ``tokenizer_config.json``'s ``fast_tokenizer_files`` names), else from a
vocabulary file of the tokenizer class: a SentencePiece or tiktoken ``*.model``
(``tokenizer.model``, ``spiece.model``, ``sentencepiece.bpe.model``, ``tiktoken.model``, Mistral's
``tokenizer.model.v3``), Mistral's ``tekken.json``, ``*.tiktoken``, a BPE ``vocab.json`` (with
``merges.txt``), a WordPiece ``vocab.txt``, or one of a few model-specific vocabularies.
``tokenizer_config.json`` and ``special_tokens_map.json`` only configure it; only byte-level
classes (ByT5, CANINE, Perceiver, Dia) need no file at all.  Without any of these, transformers
fails with a multi-line message that names no file ("Couldn't instantiate the backend tokenizer
...", a Llama checkpoint) or, for a class with a built-in default (Qwen2 in 5.x), builds a
tokenizer with an empty vocabulary that turns every text into no tokens; either only once the
processes that load it have started, so the launcher and the PD master refuse such a directory
first.  The rule errs towards accepting: a file here that the checkpoint's tokenizer class does
not read (a ``vocab.txt`` beside a Llama config) is left for transformers to judge.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any, List

TOKENIZER_JSON = "tokenizer.json"
TOKENIZER_CONFIG = "tokenizer_config.json"
# Vocabulary files by name (the model-specific ones are those of transformers' tokenizer classes).
VOCABULARY_NAMES = ("vocab.json", "vocab.txt", "vocab-src.json", "target_vocab.json", "byte_maps.json",
                    "prophetnet.tokenizer")
# Vocabulary files by pattern: SentencePiece or tiktoken models, Mistral's tekken, tiktoken ranks.
VOCABULARY_PATTERNS = ("*.model", "tokenizer.model.*", "*.spm", "*tekken*.json", "*.tiktoken")
# Tokenizer classes that map bytes or characters to ids by rule, with no vocabulary file.
FILELESS_CLASSES = frozenset({"ByT5Tokenizer", "CanineTokenizer", "PerceiverTokenizer", "DiaTokenizer"})

# What a refusal says was looked for.
LOOKED_FOR = ("tokenizer.json, or a vocabulary (tokenizer.model or another SentencePiece/tiktoken *.model, "
              "tekken.json, *.tiktoken, vocab.json with merges.txt, vocab.txt)")


class TokenizerFilesError(ValueError):
    """The checkpoint directory has no file a tokenizer can be built from."""


def read_tokenizer_config(directory: Path) -> dict[str, Any]:
    """``tokenizer_config.json`` of ``directory`` as a dict ({} when absent or unreadable)."""
    try:
        value = json.loads((directory / TOKENIZER_CONFIG).read_text())
    except (OSError, UnicodeDecodeError, ValueError):
        return {}
    return value if isinstance(value, dict) else {}


def tokenizer_sources(model_dir: str | Path) -> List[str]:
    """The names of ``model_dir``'s files a tokenizer can be built from, sorted (see the module docstring).

    A byte-level tokenizer class named by ``tokenizer_config.json`` counts as that file.
    """
    directory = Path(model_dir)
    config = read_tokenizer_config(directory)
    if config.get("tokenizer_class") in FILELESS_CLASSES:
        return [TOKENIZER_CONFIG]
    serialized = config.get("fast_tokenizer_files")
    names = {TOKENIZER_JSON, *VOCABULARY_NAMES, *(serialized if isinstance(serialized, list) else [])}
    found = {name for name in names if isinstance(name, str) and (directory / name).is_file()}
    found.update(path.name for pattern in VOCABULARY_PATTERNS for path in directory.glob(pattern) if path.is_file())
    return sorted(found)


def check_tokenizer_sources(model_dir: str | Path) -> None:
    """Raise :class:`TokenizerFilesError` (one line naming the directory and what was looked for)
    when ``model_dir`` holds no file a tokenizer can be built from."""
    directory = Path(model_dir)
    if tokenizer_sources(model_dir):
        return
    configured = [name for name in (TOKENIZER_CONFIG, "special_tokens_map.json") if (directory / name).is_file()]
    held = (f", and its {' and '.join(configured)} only configure{'s' if len(configured) == 1 else ''} one"
            if configured else "")
    raise TokenizerFilesError(f"no tokenizer files in {directory}: looked for {LOOKED_FOR}{held}; copy the "
                              f"model's tokenizer files into the directory")
