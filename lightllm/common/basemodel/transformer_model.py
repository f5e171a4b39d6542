"""The decoder-only transformer template that Llama-family models instantiate."""

from __future__ import annotations

import logging
import re
from typing import List, Optional

import torch
import torch.nn.functional as F

from lightllm.common.basemodel.attention.base import AttentionBackend
from lightllm.common.basemodel.attention.torch_sdpa import TorchSdpaAttention
from lightllm.common.basemodel.forward_batch import ForwardBatch
from lightllm.common.basemodel.kv_head_split import kv_head_slice
from lightllm.common.basemodel.layer_ops import rms_norm
from lightllm.common.basemodel.layer_ops_select import build_layer_ops
from lightllm.common.basemodel.layer_weights import DecoderLayerWeights
from lightllm.common.basemodel.linear_kernels import build_linear
from lightllm.common.basemodel.model_config import ModelConfig
from lightllm.common.basemodel.serving_dtype import parse_dtype
from lightllm.common.basemodel.parallel import TensorParallelGroup, shard_range
from lightllm.common.basemodel.rotary import RotaryEmbedding
from lightllm.common.basemodel.weight_loader import CheckpointError, SafetensorsCheckpoint
from lightllm.common.kv_cache_mem_manager.mem_manager import KVCacheMemoryManager

log = logging.getLogger("lightllm.model")

# The layer index of a decoder-layer tensor name, as every supported architecture writes it.
_LAYER_INDEX = re.compile(r"^model\.layers\.(\d+)\.")


class DecoderOnlyTransformer:
    """RMSNorm + RoPE + grouped-query attention + SwiGLU, the Llama / Mistral / Qwen2 / Qwen3 layout.

    Subclasses name their checkpoint tensors through the ``*_name`` hooks.  The embedding is
    replicated on every rank; the LM head is vocab-parallel and gathered into full logits.
    """

    requires_qk_norm = False
    embed_name = "model.embed_tokens.weight"
    final_norm_name = "model.norm.weight"
    lm_head_name = "lm_head.weight"

    def uses_qkv_bias(self, config: ModelConfig) -> bool:
        """Whether the q/k/v projections have biases (``attention_bias`` in Llama and Qwen3)."""
        return config.attention_bias

    def uses_o_bias(self, config: ModelConfig) -> bool:
        """Whether ``o_proj`` has a bias (``attention_bias`` in Llama and Qwen3)."""
        return config.attention_bias

    def layer_prefix(self, index: int) -> str:
        """Checkpoint name prefix of decoder layer ``index``."""
        return f"model.layers.{index}."

    def __init__(
        self,
        model_dir: str,
        config: ModelConfig,
        dtype: Optional[torch.dtype] = None,
        device: torch.device | str = "cpu",
        tp: Optional[TensorParallelGroup] = None,
        attention: Optional[AttentionBackend] = None,
        linear_backend: str = "torch",
    ):
        self.config = config
        # The config keeps the name (torch-free); a dtype given here is checked against the same
        # served set (float32, float16, bfloat16), names ("bf16") included.
        self.dtype = parse_dtype(dtype if dtype is not None else config.dtype)
        self.device = torch.device(device)
        self.tp = tp or TensorParallelGroup()
        self.attention = attention or TorchSdpaAttention()
        heads = shard_range(config.num_attention_heads, self.tp.rank, self.tp.world_size, "num_attention_heads")
        kv_heads = kv_head_slice(config.num_key_value_heads, self.tp.rank, self.tp.world_size)
        self.local_q_heads = heads.stop - heads.start
        self.local_kv_heads = kv_heads.stop - kv_heads.start
        self.head_dim = config.head_dim
        ckpt = SafetensorsCheckpoint(model_dir)
        self.embed_weight = ckpt.get(self.embed_name, self.dtype, shape=(config.vocab_size, config.hidden_size),
                                     shape_source="vocab_size, hidden_size").to(self.device)
        # Kept on the model: the config is shared with whoever built it and must not change under them.
        self.vocab_size = int(self.embed_weight.shape[0])
        self.layers: List[DecoderLayerWeights] = [
            DecoderLayerWeights.load(
                ckpt, self.layer_prefix(i), config, self.tp, self.dtype, self.device, linear_backend,
                qk_norm=self.requires_qk_norm, qkv_bias=self.uses_qkv_bias(config), o_bias=self.uses_o_bias(config),
            )
            for i in range(config.num_hidden_layers)
        ]
        self.final_norm = ckpt.get(self.final_norm_name, self.dtype, shape=(config.hidden_size,),
                                   shape_source="hidden_size").to(self.device)
        self.linear_backend = linear_backend
        self.lm_head = build_linear(linear_backend, self._load_lm_head(ckpt))
        self._refuse_unread_tensors(ckpt)
        ckpt.close()
        self.rotary = RotaryEmbedding(config.rope, config.head_dim, config.max_position_embeddings, self.device)
        self.layer_ops = build_layer_ops(self.attention.layer_kernels(), self.rotary)
        self.attention.warmup(self.local_q_heads, self.local_kv_heads, self.head_dim, self.dtype, self.device)

    def _refuse_unread_tensors(self, ckpt: SafetensorsCheckpoint) -> None:
        """Refuse a checkpoint holding weights the forward would not use.

        Such a tensor belongs to an architecture this class does not run (an MLP bias, extra
        norms, other layers): serving without it gives wrong output with no error.  Rotary
        frequency buffers are derived from the config.
        """
        unread = [name for name in ckpt.unread() if not name.endswith("rotary_emb.inv_freq")]
        extra_layers = sorted({int(match.group(1)) for match in map(_LAYER_INDEX.match, unread)
                               if match and int(match.group(1)) >= self.config.num_hidden_layers})
        if extra_layers:
            raise CheckpointError(
                f"checkpoint {ckpt.model_dir} holds layers {extra_layers[0]} to {extra_layers[-1]} beyond "
                f"num_hidden_layers={self.config.num_hidden_layers}: config.json's layer count does not match the weights"
            )
        if unread:
            shown = ", ".join(unread[:5]) + (f" and {len(unread) - 5} more" if len(unread) > 5 else "")
            raise CheckpointError(
                f"checkpoint {ckpt.model_dir} holds tensors a {self.config.model_type} model does not use "
                f"({shown}); it is another architecture, which this server cannot run"
            )

    def _load_lm_head(self, ckpt: SafetensorsCheckpoint) -> torch.Tensor:
        vocab = self.vocab_size
        # As transformers loads it: a head in the checkpoint is the head, even under a tied config
        # (transformers then does not tie them); without one the head is the embedding, which an
        # untied config does not allow.
        if ckpt.has(self.lm_head_name):
            full = ckpt.get(self.lm_head_name, self.dtype, shape=(self.config.vocab_size, self.config.hidden_size),
                            shape_source="vocab_size, hidden_size").to(self.device)
            if torch.equal(full, self.embed_weight):
                full = self.embed_weight  # a tied head saved twice: keep one copy
            elif self.config.tie_word_embeddings and self.tp.rank == 0:
                # transformers warns of the same contradiction and likewise keeps the head.
                log.warning("config.json ties the LM head to the embedding (tie_word_embeddings), but the checkpoint's "
                            "%s differs from the embedding: the head is used, as transformers does", self.lm_head_name)
        elif self.config.tie_word_embeddings:
            full = self.embed_weight
        else:
            raise CheckpointError(f"checkpoint {ckpt.model_dir} has no tensor {self.lm_head_name!r} and its config "
                                  "does not tie the LM head to the embedding (tie_word_embeddings is false)")
        world = self.tp.world_size
        per_rank = -(-vocab // world)
        if per_rank * world != vocab:
            # Pad so that every rank gathers an equal share; padded logits are cut afterwards.
            full = torch.cat([full, full.new_zeros(per_rank * world - vocab, full.shape[1])])
        return full[self.tp.rank * per_rank : (self.tp.rank + 1) * per_rank].contiguous()

    def new_kv_cache(self, size: int) -> KVCacheMemoryManager:
        """A KV cache of ``size`` token slots shaped for this rank's layers."""
        return KVCacheMemoryManager(
            size, self.config.num_hidden_layers, self.local_kv_heads, self.head_dim, self.dtype, self.device
        )

    @torch.inference_mode()
    def forward(self, batch: ForwardBatch, kv_cache: KVCacheMemoryManager, req_to_token: torch.Tensor) -> torch.Tensor:
        """Run the batch, writing new K/V into ``kv_cache``; returns float32 logits.

        Logits are ``[batch_size, vocab]`` for each request's last new token, or
        ``[total_new_tokens, vocab]`` when ``batch.all_logits``, or one row per entry of
        ``batch.logit_index`` when that is set (prompt logprobs need a few more positions).
        """
        num_tokens = batch.input_ids.shape[0]
        q_size = self.local_q_heads * self.head_dim
        kv_size = self.local_kv_heads * self.head_dim
        hidden = F.embedding(batch.input_ids, self.embed_weight)
        # Per-request lengths only for a length-dependent RoPE: no list per forward otherwise.
        lengths = (batch.rope_lengths or batch.seq_lens) if self.rotary.length_dependent else None
        cos, sin = self.rotary.cos_sin(batch.positions, batch.max_position, lengths, batch.new_lens)
        meta = self.attention.prepare(batch, req_to_token)
        ops, eps = self.layer_ops, self.config.rms_norm_eps
        # The rows that get logits.  After the last layer's attention nothing else reads the other
        # rows (their K/V are in the cache by then), so that layer's output projection and MLP,
        # the last residual add and the final norm run on these rows only: in a prefill that
        # saves about 1/num_layers of the projection work.
        rows = batch.logit_index
        if rows is None and not batch.all_logits:
            rows = batch.last_token_index
        if rows is not None and batch.logit_index is None and rows.shape[0] == num_tokens:
            # A decode: every request's last token is every row.  Only then: a logit_index as
            # long as the batch (a prompt-logprob chunk's last row listed twice beside chunks
            # that want one row of several) is not every row in order.
            rows = None
        last_layer = len(self.layers) - 1
        # ``hidden`` is the residual stream: the embedding's fresh output, updated in place.
        mlp_out: Optional[torch.Tensor] = None  # added to the residual by the next norm
        for index, layer in enumerate(self.layers):
            x = ops.add_rms_norm(hidden, mlp_out, layer.input_norm, eps)
            qkv = layer.qkv(x)
            q, k, v = qkv.split([q_size, kv_size, kv_size], dim=-1)
            q = q.view(num_tokens, self.local_q_heads, self.head_dim)
            k = k.view(num_tokens, self.local_kv_heads, self.head_dim)
            if layer.q_norm is not None:
                q, k = rms_norm(q, layer.q_norm, eps), rms_norm(k, layer.k_norm, eps)
            q = ops.apply_rotary(q, cos, sin)
            k = ops.apply_rotary(k, cos, sin)
            kv_cache.write(index, batch.out_slots, k, v.view(num_tokens, self.local_kv_heads, self.head_dim))
            attn = self.attention.forward(q, kv_cache.k_buffer[index], kv_cache.v_buffer[index], meta)
            attn = attn.reshape(num_tokens, q_size)
            if index == last_layer and rows is not None:
                attn, hidden = attn[rows], hidden[rows]
            attn_out = self.tp.all_reduce(layer.o(attn))
            if layer.o_bias is not None:
                attn_out.add_(layer.o_bias)
            x = ops.add_rms_norm(hidden, attn_out, layer.post_attention_norm, eps)
            act = ops.silu_and_mul(layer.gate_up(x))
            mlp_out = self.tp.all_reduce(layer.down(act))
        if rows is not None and not self.layers:
            hidden = hidden[rows]
        if mlp_out is not None:
            hidden = hidden + mlp_out
        hidden = rms_norm(hidden, self.final_norm, eps)
        logits = self.tp.all_gather_last_dim(self.lm_head(hidden).float())
        return logits[:, : self.vocab_size]
