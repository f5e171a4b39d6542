"""Loading the checkpoint's tokenizer from its local directory (never from a hub)."""

from __future__ import annotations

import logging
from typing import Any

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
