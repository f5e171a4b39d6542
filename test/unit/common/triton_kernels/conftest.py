"""Fixtures of the Triton kernel tests.

Without a GPU the kernels run in Triton's CPU interpreter: ``test/conftest.py`` sets
``TRITON_INTERPRET=1`` before any test module can import triton (triton builds its language
functions for the interpreter only when the variable is set at import).  With a GPU the variable
is left alone and the same tests run the compiled kernels on CUDA tensors.
"""

from __future__ import annotations

import pytest
import torch


@pytest.fixture(scope="session")
def device() -> torch.device:
    """Where the kernels run: the GPU when there is one, else the CPU (interpreter)."""
    return torch.device("cuda" if torch.cuda.is_available() else "cpu")
