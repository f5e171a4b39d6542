"""Llama: the decoder-only template as is (no attention biases unless the config asks)."""

from lightllm.common.basemodel.transformer_model import DecoderOnlyTransformer


class LlamaModel(DecoderOnlyTransformer):
    """Llama and Llama-compatible checkpoints (``model_type: llama``)."""
