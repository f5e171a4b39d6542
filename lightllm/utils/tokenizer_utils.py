"""Loading the checkpoint's tokenizer from its local directory (never from a hub)."""

from __future__ import annotations

import logging
from typing import Any, FrozenSet

from lightllm.utils.torch_free import quiet_transformers_without_torch


def load_tokenizer(model_dir: str, tokenizer_mode: str = "fast") -> Any:
    """The Hugging Face tokenizer stored in ``model_dir``."""
    with quiet_transformers_without_torch():
        from transformers import AutoTokenizer

    use_fast = tokenizer_mode != "slow"
    tokenizer = AutoTokenizer.from_pretrained(model_dir, use_fast=use_fast, local_files_only=True, trust_remote_code=False)
    if not use_fast and getattr(tokenizer, "is_fast", False):
        # transformers falls back to the fast tokenizer when the checkpoint has no slow one.
        logging.getLogger(__name__).warning(
            "--tokenizer_mode slow: %s has no slow (Python) tokenizer; using its fast one", model_dir)
    return tokenizer


def tokenizer_special_ids(tokenizer: Any) -> FrozenSet[int]:
    """The ids a Hugging Face tokenizer treats as special: ``all_special_ids`` and the added tokens
    flagged ``special`` (what ``skip_special_tokens`` skips)."""
    ids = set(getattr(tokenizer, "all_special_ids", None) or [])
    added = getattr(tokenizer, "added_tokens_decoder", None)
    if isinstance(added, dict):
        ids.update(token_id for token_id, token in added.items() if getattr(token, "special", False))
    return frozenset(ids)
