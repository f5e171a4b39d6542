"""Seeded random weights for demo Llama / Mistral / Qwen2 / Qwen3 checkpoints, named as transformers names them.

The weights are random but scaled so that the model behaves like a trained one in the
ways tests can observe: every sublayer moves the residual stream by about as much as the
embedding does, attention scores spread over about one unit (so attention is far from
uniform and position bugs change the output), and logits have a spread of a few units (so
greedy decoding does not lock onto one token).  Norm weights and biases are not their
neutral values, so a loader that drops or swaps them produces visibly different logits.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Dict, List, Tuple

import torch

from lightllm.utils.demo_model_config import DemoArch, DemoModelSize

# Scales chosen by checking 32-token greedy continuations of both archs over several seeds
# and prompts.  With plain std=0.02 everywhere the tied (qwen2) model repeats one token
# forever and logits spread by only ~0.16; with LINEAR_GAIN=1 and BIAS_STD=0.3 the tied
# model still falls into short cycles because the token's own embedding dominates its
# logits.  With the values below continuations hold ~20-30 distinct tokens and attention
# over a few hundred tokens stays clearly non-uniform.
EMBED_GAIN = 2.0  # embedding / lm_head std = EMBED_GAIN / sqrt(hidden) -> logit std ~ EMBED_GAIN
QK_GAIN = 1.25  # q/k std = QK_GAIN / sqrt(fan_in) -> attention score std ~ QK_GAIN**2
LINEAR_GAIN = 1.5  # other projections: std = LINEAR_GAIN / sqrt(fan_in)
NORM_NOISE_STD = 0.1  # RMSNorm weight = 1 + N(0, NORM_NOISE_STD)
BIAS_STD = 0.1


@dataclass(frozen=True)
class TensorSpec:
    """One checkpoint tensor: its name, shape and how it is initialised."""

    name: str
    shape: Tuple[int, ...]
    kind: str  # "embedding", "qk", "linear", "norm" or "bias"


def demo_tensor_specs(arch: DemoArch, size: DemoModelSize) -> List[TensorSpec]:
    """Every tensor the checkpoint holds, in a fixed order (which fixes the random draws)."""
    hidden, inter = size.hidden_size, size.intermediate_size
    q_out = size.num_attention_heads * size.head_dim
    kv_out = size.num_key_value_heads * size.head_dim
    specs = [TensorSpec("model.embed_tokens.weight", (size.vocab_size, hidden), "embedding")]
    for i in range(size.num_hidden_layers):
        p = f"model.layers.{i}"
        specs += [
            TensorSpec(f"{p}.input_layernorm.weight", (hidden,), "norm"),
            TensorSpec(f"{p}.self_attn.q_proj.weight", (q_out, hidden), "qk"),
            TensorSpec(f"{p}.self_attn.k_proj.weight", (kv_out, hidden), "qk"),
            TensorSpec(f"{p}.self_attn.v_proj.weight", (kv_out, hidden), "linear"),
        ]
        if arch.qk_norm:
            specs += [
                TensorSpec(f"{p}.self_attn.q_norm.weight", (size.head_dim,), "norm"),
                TensorSpec(f"{p}.self_attn.k_norm.weight", (size.head_dim,), "norm"),
            ]
        if arch.qkv_bias:
            specs += [
                TensorSpec(f"{p}.self_attn.q_proj.bias", (q_out,), "bias"),
                TensorSpec(f"{p}.self_attn.k_proj.bias", (kv_out,), "bias"),
                TensorSpec(f"{p}.self_attn.v_proj.bias", (kv_out,), "bias"),
            ]
        specs += [
            TensorSpec(f"{p}.self_attn.o_proj.weight", (hidden, q_out), "linear"),
            TensorSpec(f"{p}.post_attention_layernorm.weight", (hidden,), "norm"),
            TensorSpec(f"{p}.mlp.gate_proj.weight", (inter, hidden), "linear"),
            TensorSpec(f"{p}.mlp.up_proj.weight", (inter, hidden), "linear"),
            TensorSpec(f"{p}.mlp.down_proj.weight", (hidden, inter), "linear"),
        ]
    specs.append(TensorSpec("model.norm.weight", (hidden,), "norm"))
    if not arch.tie_word_embeddings:
        specs.append(TensorSpec("lm_head.weight", (size.vocab_size, hidden), "embedding"))
    return specs


def _draw(spec: TensorSpec, gen: torch.Generator) -> torch.Tensor:
    # Scaled in place: for the medium preset an out-of-place product would allocate (and
    # page-fault in) a second 400 MB, which cost more than drawing the numbers.  The
    # in-place ops give the same bits as ``scale * noise`` / ``1 + std * noise``.
    noise = torch.randn(spec.shape, generator=gen, dtype=torch.float32)
    if spec.kind == "norm":
        return noise.mul_(NORM_NOISE_STD).add_(1.0)
    if spec.kind == "bias":
        return noise.mul_(BIAS_STD)
    fan_in = spec.shape[-1]
    gain = {"embedding": EMBED_GAIN, "qk": QK_GAIN, "linear": LINEAR_GAIN}[spec.kind]
    return noise.mul_(gain / math.sqrt(fan_in))


def init_demo_weights(arch: DemoArch, size: DemoModelSize, seed: int) -> Dict[str, torch.Tensor]:
    """Draw all weights from one CPU generator seeded with ``seed`` (float32, contiguous)."""
    gen = torch.Generator(device="cpu")
    gen.manual_seed(seed)
    return {spec.name: _draw(spec, gen).contiguous() for spec in demo_tensor_specs(arch, size)}
