"""Qwen2: Llama layout plus q/k/v projection biases, usually with tied embeddings."""

from lightllm.common.basemodel.transformer_model import DecoderOnlyTransformer


class Qwen2Model(DecoderOnlyTransformer):
    """Qwen2 checkpoints (``model_type: qwen2``): q/k/v biases are required, and the LM head is
    the embedding when ``tie_word_embeddings`` is set."""

    requires_qkv_bias = True
