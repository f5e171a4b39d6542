"""The checkpoint ``model_type`` values this build serves, readable without importing torch.

The launcher and the PD master check a checkpoint against this list before any process starts
(they never import torch); :mod:`lightllm.models.registry` maps each name to its model class.
"""

from __future__ import annotations

from typing import Dict, Optional

from lightllm.common.basemodel.model_config import ModelConfig, ModelConfigError

SUPPORTED_MODEL_TYPES = ("llama", "mistral", "qwen2", "qwen3")

# The class transformers' AutoModelForCausalLM builds for each type, as config.json's
# ``architectures`` names it.
CAUSAL_LM_CLASSES: Dict[str, str] = {
    "llama": "LlamaForCausalLM",
    "mistral": "MistralForCausalLM",
    "qwen2": "Qwen2ForCausalLM",
    "qwen3": "Qwen3ForCausalLM",
}


def check_model_type(config: ModelConfig) -> None:
    """Raise :class:`ModelConfigError` naming the supported types when ``config``'s is not one."""
    if config.model_type not in SUPPORTED_MODEL_TYPES:
        raise ModelConfigError(
            f"model_type {config.model_type!r} is not supported; supported: {', '.join(SUPPORTED_MODEL_TYPES)}"
        )


def architectures_mismatch(config: ModelConfig) -> Optional[str]:
    """A warning when config.json's ``architectures`` names another served family than ``model_type``.

    The server builds the model of ``model_type``, as transformers' AutoModelForCausalLM does
    (the numerical reference); vLLM goes by ``architectures`` and would serve another model, so
    such a checkpoint means different things to the two and its user should know which one runs.
    """
    architectures = config.raw.get("architectures")
    own = CAUSAL_LM_CLASSES.get(config.model_type)
    if not isinstance(architectures, list) or own is None or own in architectures:
        return None
    others = [name for name in architectures if name in CAUSAL_LM_CLASSES.values()]
    if not others:
        return None
    return (f"config.json: architectures names {', '.join(others)} but model_type is {config.model_type!r}: "
            f"served as {own} (by model_type, as transformers' AutoModelForCausalLM loads it; vLLM goes by "
            f"architectures and would serve {others[0]})")
