"""Loading the checkpoint's tokenizer from its local directory (never from a hub)."""

from __future__ import annotations

from typing import Any

from lightllm.utils.torch_free import quiet_transformers_without_torch


def load_tokenizer(model_dir: str, tokenizer_mode: str = "fast") -> Any:
    """The Hugging Face tokenizer stored in ``model_dir``."""
    with quiet_transformers_without_torch():
        from transformers import AutoTokenizer

    use_fast = tokenizer_mode != "slow"
    return AutoTokenizer.from_pretrained(model_dir, use_fast=use_fast, local_files_only=True, trust_remote_code=False)
