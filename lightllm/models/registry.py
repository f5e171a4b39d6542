"""Model classes by the checkpoint's ``model_type``."""

from __future__ import annotations

from typing import Dict, Optional, Type

import torch

from lightllm.common.basemodel.attention.base import AttentionBackend
from lightllm.common.basemodel.model_config import ModelConfig, ModelConfigError
from lightllm.common.basemodel.parallel import TensorParallelGroup
from lightllm.common.basemodel.transformer_model import DecoderOnlyTransformer
from lightllm.models.llama.model import LlamaModel
from lightllm.models.qwen2.model import Qwen2Model

MODEL_REGISTRY: Dict[str, Type[DecoderOnlyTransformer]] = {
    "llama": LlamaModel,
    "qwen2": Qwen2Model,
}


def supported_model_types() -> list[str]:
    """Model types this build can serve."""
    return sorted(MODEL_REGISTRY)


def load_model(
    model_dir: str,
    dtype: Optional[torch.dtype] = None,
    device: torch.device | str = "cpu",
    tp: Optional[TensorParallelGroup] = None,
    attention: Optional[AttentionBackend] = None,
    linear_backend: str = "torch",
) -> DecoderOnlyTransformer:
    """Read ``model_dir``'s config, pick the class for its ``model_type`` and load the weights."""
    config = ModelConfig.from_dir(model_dir)
    model_cls = MODEL_REGISTRY.get(config.model_type)
    if model_cls is None:
        raise ModelConfigError(
            f"model_type {config.model_type!r} is not supported; supported: {', '.join(supported_model_types())}"
        )
    return model_cls(model_dir, config, dtype=dtype, device=device, tp=tp, attention=attention,
                     linear_backend=linear_backend)
