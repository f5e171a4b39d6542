"""Loading the checkpoint's tokenizer from its local directory (never from a hub)."""

from __future__ import annotations

import importlib.util
import logging
from pathlib import Path
from typing import Any, FrozenSet, List, Optional

from lightllm.utils.tokenizer_sources import check_tokenizer_sources
from lightllm.utils.torch_free import quiet_transformers_without_torch


def sentencepiece_packages_missing(model_dir: str) -> List[str]:
    """Packages transformers needs for a checkpoint whose only tokenizer is ``tokenizer.model``
    and that are not installed (empty when the checkpoint has a ``tokenizer.json`` too)."""
    directory = Path(model_dir)
    if (directory / "tokenizer.json").is_file() or not (directory / "tokenizer.model").is_file():
        return []
    return [name for name, module in (("sentencepiece", "sentencepiece"), ("protobuf", "google.protobuf"))
            if not _importable(module)]


def _importable(module: str) -> bool:
    try:
        return importlib.util.find_spec(module) is not None
    except ModuleNotFoundError:  # a parent package (google) that is not there
        return False


def load_tokenizer(model_dir: str, tokenizer_mode: str = "fast", warn: bool = True) -> Any:
    """The Hugging Face tokenizer stored in ``model_dir``.

    Raises :class:`~lightllm.utils.tokenizer_sources.TokenizerFilesError` (one line) when the
    directory holds no tokenizer files, and a ``ValueError`` naming the packages a
    ``tokenizer.model``-only checkpoint needs when they are missing.
    """
    if Path(model_dir).is_dir():
        # The launcher refuses such a directory before any process starts; a caller loading it
        # directly (the benchmarks) gets the same one line, not transformers' failure or, for a
        # Qwen2 config, a tokenizer of empty vocabulary.
        check_tokenizer_sources(model_dir)
    with quiet_transformers_without_torch():
        from transformers import AutoTokenizer

    use_fast = tokenizer_mode != "slow"
    try:
        tokenizer = AutoTokenizer.from_pretrained(model_dir, use_fast=use_fast, local_files_only=True,
                                                  trust_remote_code=False)
    except Exception as exc:
        missing = sentencepiece_packages_missing(model_dir)
        if not missing:
            raise
        # transformers names the missing packages in a warning lines before, then fails on an
        # unrelated-looking parse error of tokenizer.model: say what is missing instead.
        raise ValueError(f"{model_dir} has only a SentencePiece tokenizer.model (no tokenizer.json), which "
                         f"transformers reads with the {' and '.join(missing)} package(s): install them "
                         f"({type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''})") from exc
    if warn and not use_fast and getattr(tokenizer, "is_fast", False):
        # transformers falls back to the fast tokenizer when the checkpoint has no slow one.
        logging.getLogger(__name__).warning(
            "--tokenizer_mode slow: %s has no slow (Python) tokenizer; using its fast one", model_dir)
    return tokenizer


def slow_tokenizer_problem(model_dir: str) -> Optional[str]:
    """Why ``--tokenizer_mode slow`` would serve ``model_dir`` with a fast tokenizer anyway, or None.

    transformers falls back to the fast tokenizer silently when the checkpoint has no slow one,
    and transformers 5 loads most tokenizer classes through their fast backend whatever is asked.
    """
    # Loaded first: the launcher keeps torch out, and transformers' first import must be the
    # quiet one in load_tokenizer (else it advises that PyTorch was not found above the error).
    tokenizer = load_tokenizer(model_dir, "slow", warn=False)
    import transformers

    if not getattr(tokenizer, "is_fast", False):
        return None
    return (f"transformers {transformers.__version__} loads {model_dir}'s tokenizer ({type(tokenizer).__name__}) "
            "through its fast backend even when asked for a slow (Python) one")


def tokenizer_special_ids(tokenizer: Any) -> FrozenSet[int]:
    """The ids a Hugging Face tokenizer treats as special: ``all_special_ids`` and the added tokens
    flagged ``special`` (what ``skip_special_tokens`` skips)."""
    ids = set(getattr(tokenizer, "all_special_ids", None) or [])
    added = getattr(tokenizer, "added_tokens_decoder", None)
    if isinstance(added, dict):
        ids.update(token_id for token_id, token in added.items() if getattr(token, "special", False))
    return frozenset(ids)
