"""transformers' values for the ``config.json`` keys a checkpoint may leave out, per ``model_type``.

A checkpoint saved by another tool (or trimmed by hand) can omit keys that transformers' config
class then fills with its own default, and that default differs by architecture: a missing
``max_position_embeddings`` is 2048 for Llama but 32768 for Qwen2, a missing ``num_key_value_heads``
is ``num_attention_heads`` for Llama but 8 for Mistral.  Serving such a checkpoint as transformers
loads it needs the same per-architecture values, so they are written out here instead of importing
transformers (the launcher and the PD master read configs without it, and it is slow to import).

Each value is the field default of the config class in transformers 5.x
(``transformers/models/<model_type>/configuration_<model_type>.py``: ``LlamaConfig``,
``MistralConfig``, ``Qwen2Config``, ``Qwen3Config``); test/unit/common/test_architecture_defaults.py
compares every one with the installed transformers, so a change there fails a test.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Dict, Optional


@dataclass(frozen=True)
class ArchitectureDefaults:
    """What one architecture's transformers config class gives a key ``config.json`` leaves out.

    ``num_key_value_heads`` / ``head_dim`` None: derived, as the config class's ``__post_init__``
    derives them (``num_attention_heads``; ``hidden_size // num_attention_heads``).
    ``sliding_window`` None: the class has no default window.  ``max_window_layers`` and
    ``use_sliding_window`` are read only for the architectures that have them (Qwen2, Qwen3).
    """

    model_type: str
    max_position_embeddings: int
    num_key_value_heads: Optional[int]
    head_dim: Optional[int]
    sliding_window: Optional[int] = None
    max_window_layers: Optional[int] = None
    use_sliding_window: bool = False
    rms_norm_eps: float = 1e-6
    # RotaryEmbeddingConfigMixin.default_theta (modeling_rope_utils.py); no class of the four overrides it.
    rope_theta: float = 10000.0
    hidden_act: str = "silu"
    tie_word_embeddings: bool = False
    attention_bias: bool = False

    def describe(self, key: str, value: object) -> str:
        """Where ``key``'s value came from when config.json lacks it, for error messages."""
        if key == "num_key_value_heads" and self.num_key_value_heads is None:
            return f"not in config.json; num_attention_heads, as transformers derives it for {self.model_type}"
        return f"not in config.json; transformers' default for {self.model_type} is {value}"


# LlamaConfig: max_position_embeddings 2048, num_key_value_heads None -> num_attention_heads,
# head_dim None -> hidden_size // num_attention_heads; no sliding window.
LLAMA_DEFAULTS = ArchitectureDefaults(model_type="llama", max_position_embeddings=2048, num_key_value_heads=None,
                                      head_dim=None)
# MistralConfig: max_position_embeddings 4096 * 32, num_key_value_heads 8, head_dim None -> derived,
# sliding_window 4096 on every layer (no use_sliding_window / max_window_layers keys).
MISTRAL_DEFAULTS = ArchitectureDefaults(model_type="mistral", max_position_embeddings=131072, num_key_value_heads=8,
                                        head_dim=None, sliding_window=4096)
# Qwen2Config: max_position_embeddings 32768, num_key_value_heads 32, no head_dim field (the model
# derives it), sliding_window 4096 from max_window_layers 28 on, only with use_sliding_window.
QWEN2_DEFAULTS = ArchitectureDefaults(model_type="qwen2", max_position_embeddings=32768, num_key_value_heads=32,
                                      head_dim=None, sliding_window=4096, max_window_layers=28)
# Qwen3Config: as Qwen2Config, with head_dim 128.
QWEN3_DEFAULTS = ArchitectureDefaults(model_type="qwen3", max_position_embeddings=32768, num_key_value_heads=32,
                                      head_dim=128, sliding_window=4096, max_window_layers=28)

ARCHITECTURE_DEFAULTS: Dict[str, ArchitectureDefaults] = {
    defaults.model_type: defaults for defaults in (LLAMA_DEFAULTS, MISTRAL_DEFAULTS, QWEN2_DEFAULTS, QWEN3_DEFAULTS)
}


def architecture_defaults(model_type: str) -> ArchitectureDefaults:
    """The defaults of ``model_type``; Llama's for a type this server does not serve.

    An unsupported type is refused by the caller (``check_model_type``) after the config is read,
    naming the supported ones; reading it first with Llama's (transformers' base) values keeps
    that refusal the one the user sees.
    """
    return ARCHITECTURE_DEFAULTS.get(model_type, LLAMA_DEFAULTS)
