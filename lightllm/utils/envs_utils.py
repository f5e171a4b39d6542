"""Every LIGHTLLM_* environment variable the server reads, with its meaning and default.

Flags belong in the argument parser; environment variables are kept for process-level knobs
that deployments set once (and for names LightLLM users already know).
"""

from __future__ import annotations

import os
from typing import List, Optional

ENV_VARS = {
    "LIGHTLLM_TORCH_THREADS": "Intra-op threads of each CPU model rank; default: (CPU cores - 1) divided by --tp, at least 1.",
    "LIGHTLLM_API_KEY": "Comma-separated API keys, used when --api_key is not given (keeps keys out of the process list).",
    "LIGHTLLM_ADMIN_API_KEY": "Comma-separated admin API keys, used when --admin_api_key is not given.",
    "LIGHTLLM_IDLE_MALLOC_TRIM": "0 stops model ranks from returning freed heap memory to the kernel when idle (malloc_trim); default 1.",
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


def api_keys_from_env(name: str) -> List[str]:
    """The comma-separated keys in environment variable ``name`` (empty entries dropped)."""
    return [key.strip() for key in os.environ.get(name, "").split(",") if key.strip()]
