"""Size presets and ``config.json`` / ``generation_config.json`` contents for demo models.

``config.json`` is written the way transformers 5.x writes it (``dtype``,
``rope_parameters``) and additionally carries the 4.x spellings (``torch_dtype``,
top-level ``rope_theta``) so that either major version, and our own loader, reads it.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Dict, List

from lightllm.utils.demo_tokenizer import DemoSpecialTokens

ROPE_THETA = 10000.0
RMS_NORM_EPS = 1e-6


@dataclass(frozen=True)
class DemoModelSize:
    """Shape of one demo model preset."""

    vocab_size: int
    hidden_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    intermediate_size: int
    max_position_embeddings: int

    @property
    def head_dim(self) -> int:
        """Per-head width: ``hidden_size`` over ``num_attention_heads``."""
        return self.hidden_size // self.num_attention_heads

    def num_parameters(self, arch: DemoArch) -> int:
        """Parameter count of the checkpoint for ``arch``, from the shape alone.

        Kept next to the presets (rather than only summing tensors) so that docs, CLI help
        and tests can quote a size without writing hundreds of megabytes of weights.
        """
        hidden, inter = self.hidden_size, self.intermediate_size
        q_out = self.num_attention_heads * self.head_dim
        kv_out = self.num_key_value_heads * self.head_dim
        attn = hidden * q_out + 2 * hidden * kv_out + q_out * hidden
        if arch.qkv_bias:
            attn += q_out + 2 * kv_out
        if arch.qk_norm:
            attn += 2 * self.head_dim
        per_layer = attn + 3 * hidden * inter + 2 * hidden  # q/k/v/o, gate/up/down, two norms
        heads = 1 if arch.tie_word_embeddings else 2  # embedding, plus lm_head unless tied
        return heads * self.vocab_size * hidden + self.num_hidden_layers * per_layer + hidden


# tiny: loads and runs a forward pass in milliseconds, for unit tests.
# small: ~5M parameters (llama) with a 4K context, for end-to-end runs and benchmarks;
#   a decode step is dominated by per-token overhead, not by matrix products.
# medium: ~99M parameters (llama; ~82M qwen2, whose lm_head is the embedding), hidden 1024,
#   8 layers, GQA 16/4 heads of 64: wide enough that matrix products dominate a step, so
#   thread and batching decisions tuned on it are not tuned to per-token overhead.  The
#   vocabulary is 16384 because the standard-library corpus reaches about 19.8K BPE tokens
#   at most (and fewer on a trimmed interpreter); 16384 keeps a margin.  The intermediate
#   size 1792 (7 x 256, 1.75 x hidden) brings the llama total to ~100M while staying a
#   multiple of 256 for the matrix-product kernels.
SIZES: Dict[str, DemoModelSize] = {
    "tiny": DemoModelSize(
        vocab_size=1024,
        hidden_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        intermediate_size=128,
        max_position_embeddings=1024,
    ),
    "small": DemoModelSize(
        vocab_size=4096,
        hidden_size=256,
        num_hidden_layers=4,
        num_attention_heads=8,
        num_key_value_heads=4,
        intermediate_size=768,
        max_position_embeddings=4096,
    ),
    "medium": DemoModelSize(
        vocab_size=16384,
        hidden_size=1024,
        num_hidden_layers=8,
        num_attention_heads=16,
        num_key_value_heads=4,
        intermediate_size=1792,
        max_position_embeddings=4096,
    ),
}

ARCHITECTURES: Dict[str, str] = {
    "llama": "LlamaForCausalLM",
    "mistral": "MistralForCausalLM",
    "qwen2": "Qwen2ForCausalLM",
    "qwen3": "Qwen3ForCausalLM",
}


@dataclass(frozen=True)
class DemoArch:
    """Architecture facts that change which tensors exist."""

    name: str

    @property
    def qkv_bias(self) -> bool:
        """Whether q/k/v have biases (Qwen2 only)."""
        return self.name == "qwen2"

    @property
    def tie_word_embeddings(self) -> bool:
        """Whether the LM head is the embedding (Qwen2 and Qwen3)."""
        return self.name in ("qwen2", "qwen3")

    @property
    def qk_norm(self) -> bool:
        """Whether q and k have per-head RMSNorms (Qwen3 only)."""
        return self.name == "qwen3"


def check_arch(arch: str) -> DemoArch:
    """Validate an architecture name.

    Raises:
        ValueError: if ``arch`` is not one of :data:`ARCHITECTURES`.
    """
    if arch not in ARCHITECTURES:
        raise ValueError(f"arch must be one of {sorted(ARCHITECTURES)}, got {arch!r}")
    return DemoArch(arch)


def check_size(size: str) -> DemoModelSize:
    """Look up a size preset.

    Raises:
        ValueError: if ``size`` is not one of :data:`SIZES`.
    """
    if size not in SIZES:
        raise ValueError(f"size must be one of {sorted(SIZES)}, got {size!r}")
    return SIZES[size]


def describe_size(name: str) -> str:
    """One-line shape and parameter count of a preset, for CLI help and error messages.

    Derived from :data:`SIZES` so the help text cannot drift from the presets.
    """
    size = check_size(name)
    llama = size.num_parameters(DemoArch("llama")) / 1e6
    qwen2 = size.num_parameters(DemoArch("qwen2")) / 1e6
    return (
        f"{name}: hidden {size.hidden_size}, {size.num_hidden_layers} layers, "
        f"{size.num_attention_heads}/{size.num_key_value_heads} heads of {size.head_dim}, "
        f"intermediate {size.intermediate_size}, vocab {size.vocab_size}, context {size.max_position_embeddings}; "
        f"{llama:.1f}M params (llama), {qwen2:.1f}M (qwen2)"
    )


def model_config(arch: DemoArch, size: DemoModelSize, special: DemoSpecialTokens) -> Dict[str, object]:
    """Contents of ``config.json`` for ``arch`` at ``size``."""
    config: Dict[str, object] = {
        "architectures": [ARCHITECTURES[arch.name]],
        "attention_dropout": 0.0,
        "bos_token_id": special.bos_id,
        "dtype": "float32",
        "eos_token_id": special.eos_id,
        "head_dim": size.head_dim,
        "hidden_act": "silu",
        "hidden_size": size.hidden_size,
        "initializer_range": 0.02,
        "intermediate_size": size.intermediate_size,
        "max_position_embeddings": size.max_position_embeddings,
        "model_type": arch.name,
        "num_attention_heads": size.num_attention_heads,
        "num_hidden_layers": size.num_hidden_layers,
        "num_key_value_heads": size.num_key_value_heads,
        "pad_token_id": special.pad_id,
        "rms_norm_eps": RMS_NORM_EPS,
        "rope_parameters": {"rope_theta": ROPE_THETA, "rope_type": "default"},
        # 4.x spellings of dtype and rope; 5.x prefers the keys above when both exist.
        "rope_scaling": None,
        "rope_theta": ROPE_THETA,
        "tie_word_embeddings": arch.tie_word_embeddings,
        "torch_dtype": "float32",
        "use_cache": True,
        "vocab_size": size.vocab_size,
    }
    if arch.name == "llama":
        config.update({"attention_bias": False, "mlp_bias": False, "pretraining_tp": 1})
    elif arch.name == "mistral":
        config["sliding_window"] = None  # transformers' Mistral defaults to a 4096-token window
    else:
        layers: List[str] = ["full_attention"] * size.num_hidden_layers
        config.update(
            {
                "layer_types": layers,
                "max_window_layers": size.num_hidden_layers,
                "sliding_window": None,
                "use_sliding_window": False,
            }
        )
        if arch.name == "qwen3":
            config["attention_bias"] = False
    return config


def generation_config(special: DemoSpecialTokens) -> Dict[str, object]:
    """Contents of ``generation_config.json``: greedy, stopping at ``</s>`` or ``<|im_end|>``."""
    return {
        "bos_token_id": special.bos_id,
        "do_sample": False,
        # A chat turn ends with <|im_end|>, plain completion with </s>; stop on either.
        "eos_token_id": [special.eos_id, special.im_end_id],
        "pad_token_id": special.pad_id,
    }
