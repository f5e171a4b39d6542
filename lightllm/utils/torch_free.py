"""Keeping torch out of the server processes that do not run the model.

Only the model ranks need torch. The launcher (which serves HTTP, or runs the PD master), the
router and the detokenizer import none of it (test/unit/launch/test_torch_free_processes.py), but
importing their code is not the whole story: transformers, which they use for tokenizers, imports
torch by itself whenever torch is installed, and that alone maps several hundred MiB of libraries
into the process. :func:`keep_torch_out` makes torch unimportable in the calling process, the
standard way (``sys.modules["torch"] = None``), so transformers sees no torch and stays
tokenizer-only, and any other import of torch there fails at once instead of loading it unseen.
"""

from __future__ import annotations

import contextlib
import os
import sys
from typing import Iterator


def keep_torch_out() -> bool:
    """Make ``import torch`` fail in this process from now on; returns whether it did.

    Call it first thing in a process that must not load torch. A process that has already loaded
    torch (a test calling server code in-process) is left alone: False.
    """
    if sys.modules.get("torch") is not None:
        return False
    sys.modules["torch"] = None  # type: ignore[assignment]
    return True


def torch_kept_out() -> bool:
    """Whether :func:`keep_torch_out` made torch unimportable in this process."""
    return "torch" in sys.modules and sys.modules["torch"] is None


@contextlib.contextmanager
def quiet_transformers_without_torch() -> Iterator[None]:
    """Around transformers' first import in a torch-free process: no "PyTorch was not found" advice.

    transformers logs that line (an advisory warning) when it finds no torch; here that is the intent.
    """
    if not torch_kept_out() or "transformers" in sys.modules:
        yield
        return
    name = "TRANSFORMERS_NO_ADVISORY_WARNINGS"
    saved = os.environ.get(name)
    os.environ[name] = "1"
    try:
        yield
    finally:
        if saved is None:
            os.environ.pop(name, None)
        else:
            os.environ[name] = saved
