"""Mistral: the Llama layout; its sliding window is read by the config (see ``ModelConfig.context_limit``)."""

from lightllm.common.basemodel.transformer_model import DecoderOnlyTransformer


class MistralModel(DecoderOnlyTransformer):
    """Mistral checkpoints (``model_type: mistral``).

    Served with full causal attention, which equals the sliding-window attention of the
    checkpoint while a sequence fits in the window; the launcher caps the sequence length there.
    """
