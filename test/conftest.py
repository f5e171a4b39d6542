"""Session-wide pytest fixtures shared by the whole suite.

Demo checkpoints are generated once per test session (about half a second each for the
tiny presets) into pytest's temporary directory, so every test that needs a model reads
the same files and nothing is downloaded.
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch

# Triton builds its own language functions (tl.sum, ...) for the interpreter only when
# TRITON_INTERPRET is set before `import triton`; any test may import triton first (the
# attention-backend selection does), so the variable is set here, before every test module.
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

from lightllm.utils.demo_model import generate_demo_model


@pytest.fixture(scope="session")
def tiny_llama_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Tiny random-weight Llama checkpoint (seed 0); treat it as read-only."""
    return generate_demo_model(tmp_path_factory.mktemp("tiny_llama"), arch="llama", size="tiny", seed=0)


@pytest.fixture(scope="session")
def tiny_qwen2_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Tiny random-weight Qwen2 checkpoint (seed 0, tied embeddings); treat it as read-only."""
    return generate_demo_model(tmp_path_factory.mktemp("tiny_qwen2"), arch="qwen2", size="tiny", seed=0)


@pytest.fixture(scope="session")
def tiny_qwen3_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Tiny random-weight Qwen3 checkpoint (seed 0, per-head q/k norms, tied embeddings); read-only."""
    return generate_demo_model(tmp_path_factory.mktemp("tiny_qwen3"), arch="qwen3", size="tiny", seed=0)


@pytest.fixture(scope="session")
def tiny_mistral_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Tiny random-weight Mistral checkpoint (seed 0, no sliding window); read-only."""
    return generate_demo_model(tmp_path_factory.mktemp("tiny_mistral"), arch="mistral", size="tiny", seed=0)


@pytest.fixture(scope="session")
def small_llama_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Small (~5M parameter, 4K context) random-weight Llama checkpoint (seed 0); read-only."""
    return generate_demo_model(tmp_path_factory.mktemp("small_llama"), arch="llama", size="small", seed=0)
