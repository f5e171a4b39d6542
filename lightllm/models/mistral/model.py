"""Mistral: the Llama layout without attention biases; its sliding window is read by the config
(see ``ModelConfig.context_limit``)."""

from lightllm.common.basemodel.model_config import ModelConfig
from lightllm.common.basemodel.transformer_model import DecoderOnlyTransformer


class MistralModel(DecoderOnlyTransformer):
    """Mistral checkpoints (``model_type: mistral``).

    Served with full causal attention, which equals the sliding-window attention of the
    checkpoint while a sequence fits in the window; the launcher caps the sequence length there.
    """

    def uses_qkv_bias(self, config: ModelConfig) -> bool:
        """Never: transformers' Mistral has no attention biases, whatever the config says."""
        return False

    def uses_o_bias(self, config: ModelConfig) -> bool:
        """Never (as :meth:`uses_qkv_bias`)."""
        return False
