"""Qwen3 (dense): the Llama layout plus an RMSNorm over each query and key head before RoPE."""

from lightllm.common.basemodel.transformer_model import DecoderOnlyTransformer


class Qwen3Model(DecoderOnlyTransformer):
    """Qwen3 checkpoints (``model_type: qwen3``): ``self_attn.q_norm`` / ``k_norm`` are required
    (no q/k/v biases unless the config asks); the LM head is the embedding when
    ``tie_word_embeddings`` is set."""

    requires_qk_norm = True
