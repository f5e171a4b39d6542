"""The checkpoint ``model_type`` values this build serves, readable without importing torch.

The launcher and the PD master check a checkpoint against this list before any process starts
(they never import torch); :mod:`lightllm.models.registry` maps each name to its model class.
"""

from __future__ import annotations

from lightllm.common.basemodel.model_config import ModelConfig, ModelConfigError

SUPPORTED_MODEL_TYPES = ("llama", "mistral", "qwen2", "qwen3")


def check_model_type(config: ModelConfig) -> None:
    """Raise :class:`ModelConfigError` naming the supported types when ``config``'s is not one."""
    if config.model_type not in SUPPORTED_MODEL_TYPES:
        raise ModelConfigError(
            f"model_type {config.model_type!r} is not supported; supported: {', '.join(SUPPORTED_MODEL_TYPES)}"
        )
