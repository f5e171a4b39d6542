"""Loading one decoder layer's weights, sliced for this tensor-parallel rank."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import torch

from lightllm.common.basemodel.kv_head_split import kv_head_slice
from lightllm.common.basemodel.linear_kernels import LinearKernel, build_linear
from lightllm.common.basemodel.model_config import ModelConfig
from lightllm.common.basemodel.parallel import TensorParallelGroup, shard_range
from lightllm.common.basemodel.weight_loader import SafetensorsCheckpoint


@dataclass
class DecoderLayerWeights:
    """A Llama-style layer: fused q/k/v (column parallel), o (row parallel), fused gate/up
    (column parallel), down (row parallel), and the two RMSNorm weights (replicated); Qwen3's
    per-head q/k norms and an o_proj bias when the checkpoint has them.

    The projections are kernels of the chosen linear backend (see ``linear_kernels``), which
    may hold their weight in a packed layout instead of the checkpoint's.
    """

    input_norm: torch.Tensor
    qkv: LinearKernel
    o: LinearKernel
    post_attention_norm: torch.Tensor
    gate_up: LinearKernel
    down: LinearKernel
    # Qwen3's RMSNorm weights over one query / key head (replicated), None where absent.
    q_norm: Optional[torch.Tensor] = None
    k_norm: Optional[torch.Tensor] = None
    # o_proj's bias (``attention_bias`` in Llama / Qwen3), full: added once, after the
    # row-parallel projection's all-reduce.
    o_bias: Optional[torch.Tensor] = None

    @classmethod
    def load(
        cls,
        ckpt: SafetensorsCheckpoint,
        prefix: str,
        config: ModelConfig,
        tp: TensorParallelGroup,
        dtype: torch.dtype,
        device: torch.device,
        linear_backend: str = "torch",
        qk_norm: bool = False,
        qkv_bias: bool = False,
        o_bias: bool = False,
    ) -> "DecoderLayerWeights":
        """Read ``{prefix}self_attn.*``, ``{prefix}mlp.*`` and the norms for this rank.

        ``qk_norm``, ``qkv_bias``, ``o_bias``: read the per-head ``q_norm`` / ``k_norm`` weights,
        the q/k/v biases, the ``o_proj`` bias (each required when asked for, and left unread
        otherwise, as transformers leaves a tensor its architecture does not use).
        """
        d = config.head_dim
        q_rows = shard_range(config.num_attention_heads, tp.rank, tp.world_size, "num_attention_heads")
        kv_rows = kv_head_slice(config.num_key_value_heads, tp.rank, tp.world_size)
        q_slice = slice(q_rows.start * d, q_rows.stop * d)
        kv_slice = slice(kv_rows.start * d, kv_rows.stop * d)
        inter = shard_range(config.intermediate_size, tp.rank, tp.world_size, "intermediate_size")

        hidden, q_width, kv_width = config.hidden_size, config.num_attention_heads * d, config.num_key_value_heads * d
        # A key config.json lacks is named with the default it took, so a mismatch blames the default.
        kv_heads_label, head_dim_label = config.field_label("num_key_value_heads"), config.field_label("head_dim")
        q_source = f"num_attention_heads x {head_dim_label}, hidden_size"
        kv_source = f"{kv_heads_label} x {head_dim_label}, hidden_size"
        mlp_source = "intermediate_size, hidden_size"

        def col(name: str, rows: slice, shape: tuple, source: str) -> torch.Tensor:
            return ckpt.get(prefix + name, dtype, shard_dim=0, shard=rows, shape=shape, shape_source=source)

        def row(name: str, cols: slice, shape: tuple, source: str) -> torch.Tensor:
            return ckpt.get(prefix + name, dtype, shard_dim=1, shard=cols, shape=shape, shape_source=source)

        attn = "self_attn."
        qkv = torch.cat([
            col(attn + "q_proj.weight", q_slice, (q_width, hidden), q_source),
            col(attn + "k_proj.weight", kv_slice, (kv_width, hidden), kv_source),
            col(attn + "v_proj.weight", kv_slice, (kv_width, hidden), kv_source),
        ])
        qkv_bias_tensor = None
        if qkv_bias:
            qkv_bias_tensor = torch.cat([
                col(attn + "q_proj.bias", q_slice, (q_width,), f"num_attention_heads x {head_dim_label}"),
                col(attn + "k_proj.bias", kv_slice, (kv_width,), f"{kv_heads_label} x {head_dim_label}"),
                col(attn + "v_proj.bias", kv_slice, (kv_width,), f"{kv_heads_label} x {head_dim_label}"),
            ])
        inter_width = config.intermediate_size
        gate_up = torch.cat([
            col("mlp.gate_proj.weight", inter, (inter_width, hidden), mlp_source),
            col("mlp.up_proj.weight", inter, (inter_width, hidden), mlp_source),
        ])

        def kernel(weight: torch.Tensor, bias: Optional[torch.Tensor] = None) -> LinearKernel:
            return build_linear(linear_backend, weight.to(device), None if bias is None else bias.to(device))

        def replicated(name: str, width: int, source: str) -> torch.Tensor:
            return ckpt.get(prefix + name, dtype, shape=(width,), shape_source=source).to(device)

        return cls(
            input_norm=replicated("input_layernorm.weight", hidden, "hidden_size"),
            qkv=kernel(qkv, qkv_bias_tensor),
            o=kernel(row(attn + "o_proj.weight", q_slice, (hidden, q_width),
                         f"hidden_size, num_attention_heads x {head_dim_label}")),
            post_attention_norm=replicated("post_attention_layernorm.weight", hidden, "hidden_size"),
            gate_up=kernel(gate_up),
            down=kernel(row("mlp.down_proj.weight", inter, (hidden, inter_width), "hidden_size, intermediate_size")),
            q_norm=replicated(attn + "q_norm.weight", d, head_dim_label) if qk_norm else None,
            k_norm=replicated(attn + "k_norm.weight", d, head_dim_label) if qk_norm else None,
            o_bias=replicated(attn + "o_proj.bias", hidden, "hidden_size") if o_bias else None,
        )
