"""Model classes by the checkpoint's ``model_type``."""

from __future__ import annotations

from typing import Dict, Optional, Type

import torch

from lightllm.common.basemodel.attention.base import AttentionBackend
from lightllm.common.basemodel.model_config import ModelConfig
from lightllm.common.basemodel.parallel import TensorParallelGroup
from lightllm.common.basemodel.transformer_model import DecoderOnlyTransformer
from lightllm.models.llama.model import LlamaModel
from lightllm.models.mistral.model import MistralModel
from lightllm.models.model_types import check_model_type
from lightllm.models.qwen2.model import Qwen2Model
from lightllm.models.qwen3.model import Qwen3Model

# Keyed by the names of model_types.SUPPORTED_MODEL_TYPES (a test holds the two equal).
MODEL_REGISTRY: Dict[str, Type[DecoderOnlyTransformer]] = {
    "llama": LlamaModel,
    "mistral": MistralModel,
    "qwen2": Qwen2Model,
    "qwen3": Qwen3Model,
}


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
    check_model_type(config)
    return MODEL_REGISTRY[config.model_type](model_dir, config, dtype=dtype, device=device, tp=tp, attention=attention,
                     linear_backend=linear_backend)
