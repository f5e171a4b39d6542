"""Every LIGHTLLM_* environment variable the server reads, with its meaning and default.

Flags belong in the argument parser; environment variables are kept for process-level knobs
that deployments set once (and for names LightLLM users already know).
"""

from __future__ import annotations

import os
from typing import Optional

ENV_VARS = {
    "LIGHTLLM_TORCH_THREADS": "Intra-op threads of each CPU model rank; default: (CPU cores - 1) divided by --tp, at least 1.",
}


def torch_threads_override() -> Optional[int]:
    """``LIGHTLLM_TORCH_THREADS`` as a positive int, or None when unset."""
    raw = os.environ.get("LIGHTLLM_TORCH_THREADS")
    if raw is None or raw == "":
        return None
    try:
        value = int(raw)
    except ValueError:
        raise ValueError(f"LIGHTLLM_TORCH_THREADS must be a positive integer, got {raw!r}") from None
    if value < 1:
        raise ValueError(f"LIGHTLLM_TORCH_THREADS must be a positive integer, got {raw!r}")
    return value
