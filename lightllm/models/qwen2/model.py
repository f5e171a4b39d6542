"""Qwen2: Llama layout plus q/k/v projection biases, usually with tied embeddings."""

from lightllm.common.basemodel.model_config import ModelConfig
from lightllm.common.basemodel.transformer_model import DecoderOnlyTransformer


class Qwen2Model(DecoderOnlyTransformer):
    """Qwen2 checkpoints (``model_type: qwen2``): q/k/v biases always (``o_proj`` has none), and
    the LM head is the embedding when ``tie_word_embeddings`` is set."""

    def uses_qkv_bias(self, config: ModelConfig) -> bool:
        """Always: Qwen2 has q/k/v biases whatever ``attention_bias`` says."""
        return True

    def uses_o_bias(self, config: ModelConfig) -> bool:
        """Never: Qwen2's ``o_proj`` has no bias."""
        return False
