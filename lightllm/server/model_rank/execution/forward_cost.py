"""What a forward costs on this rank: its work from the model's shapes, its time from rates measured here.

A CPU rank decides per forward whether to borrow the front end's core (see ``forward_threads``).
That decision needs the forward's size in a unit that means the same on every model width:
seconds of parallelisable work on the rank's standing thread count. Two parts make it up, and
both are counted from the checkpoint's shapes, not measured per model:

* matrix products: every decoder layer's projections and MLP plus the LM head, ``2 * params``
  FLOPs per token (the rank's shard under tensor parallelism);
* attention over the KV cache: each context position's K and V are read once per layer, a
  memory scan, ``layers * 2 * kv_dim * dtype bytes`` per position.

The two rates that turn them into seconds (matrix-product FLOP/s, KV-scan bytes/s) are measured
once at start-up on this machine with tensors of this model's shapes and its own attention kernel
(:func:`measure_rates`), so a slower CPU or a wider model moves the decision without a new constant.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Callable

import torch

from lightllm.common.basemodel.attention.base import AttentionBackend
from lightllm.common.basemodel.forward_batch import ForwardBatch
from lightllm.common.basemodel.kv_head_split import kv_heads_per_rank
from lightllm.common.basemodel.linear_kernels import build_linear
from lightllm.common.basemodel.model_config import ModelConfig


@dataclass(frozen=True)
class ForwardShape:
    """The per-rank sizes of a decoder that a forward's cost depends on."""

    layers: int
    hidden: int
    q_dim: int
    kv_dim: int
    intermediate: int
    vocab: int
    dtype_bytes: int

    @classmethod
    def from_config(cls, config: ModelConfig, tp: int, dtype: torch.dtype) -> "ForwardShape":
        """The shard one of ``tp`` ranks holds (heads, MLP columns and LM-head rows split ``tp`` ways; KV heads
        replicated when ``tp`` exceeds them)."""
        return cls(
            layers=config.num_hidden_layers,
            hidden=config.hidden_size,
            q_dim=config.num_attention_heads * config.head_dim // tp,
            kv_dim=kv_heads_per_rank(config.num_key_value_heads, tp) * config.head_dim,
            intermediate=config.intermediate_size // tp,
            vocab=-(-config.vocab_size // tp),
            dtype_bytes=torch.empty((), dtype=dtype).element_size(),
        )

    def matmul_flops_per_token(self, with_lm_head: bool = True) -> int:
        """Matrix-product FLOPs of one token through every layer (and the LM head)."""
        attention = self.hidden * (2 * self.q_dim + 2 * self.kv_dim)  # q, k, v and o projections
        mlp = 3 * self.hidden * self.intermediate  # gate, up and down
        return 2 * (self.layers * (attention + mlp) + (self.hidden * self.vocab if with_lm_head else 0))

    def kv_bytes_per_position(self) -> int:
        """Bytes of K and V one token reads per cached context position, over every layer."""
        return self.layers * 2 * self.kv_dim * self.dtype_bytes


@dataclass(frozen=True)
class MachineRates:
    """Throughputs of this rank's standing thread count on this machine."""

    matmul_flops_per_s: float
    kv_scan_bytes_per_s: float

    def __post_init__(self) -> None:
        if not (self.matmul_flops_per_s > 0 and self.kv_scan_bytes_per_s > 0):
            raise ValueError(f"rates must be positive, got {self}")


@dataclass(frozen=True)
class ForwardCostModel:
    """Seconds of parallelisable work in a forward, at the rank's standing thread count."""

    shape: ForwardShape
    rates: MachineRates

    def decode_seconds(self, rows: int, context_positions: int) -> float:
        """A decode forward of ``rows`` requests whose contexts hold ``context_positions`` positions in all."""
        return self._seconds(rows * self.shape.matmul_flops_per_token(), context_positions)

    def prefill_seconds(self, new_tokens: int, attended_positions: int, logit_rows: int) -> float:
        """A prefill forward of ``new_tokens`` tokens that attend ``attended_positions`` (token, position)
        pairs in all and compute ``logit_rows`` rows of logits."""
        flops = new_tokens * self.shape.matmul_flops_per_token(with_lm_head=False)
        flops += logit_rows * 2 * self.shape.hidden * self.shape.vocab
        return self._seconds(flops, attended_positions)

    def _seconds(self, flops: float, positions: int) -> float:
        return flops / self.rates.matmul_flops_per_s + positions * self.shape.kv_bytes_per_position() / self.rates.kv_scan_bytes_per_s


def attended_positions(start: int, new_tokens: int) -> int:
    """(token, attended position) pairs of a prefill chunk of ``new_tokens`` tokens after ``start``
    cached ones: token i of the chunk attends ``start + i + 1`` positions."""
    return new_tokens * start + new_tokens * (new_tokens + 1) // 2


def best_seconds(run: Callable[[], object], repeats: int) -> float:
    """The shortest of ``repeats`` timed runs of ``run``, after one untimed run."""
    run()  # first call pays for allocation and kernel selection
    best = float("inf")
    for _ in range(repeats):
        started = time.perf_counter()
        run()
        best = min(best, time.perf_counter() - started)
    return best


def measure_rates(shape: ForwardShape, dtype: torch.dtype, attention: AttentionBackend, head_dim: int,
                  linear_backend: str = "torch", rows: int = 32, repeats: int = 5) -> MachineRates:
    """Time this model's own shapes on the calling thread count: the MLP's up projection for ``rows``
    tokens through the model's linear backend (matrix products), and the model's attention backend running one layer's decode over a
    scratch KV cache at two context lengths (the difference is the per-position scan, without the
    per-call overhead that no thread count shortens).

    The scratch layer holds at least 32 MiB, beyond a typical last-level cache, as the real cache
    is. The best of ``repeats`` runs: a core lent to another process for a moment must not make the
    machine look slow for the server's lifetime. Takes well under a second on a CPU.
    """
    x = torch.randn(rows, shape.hidden, dtype=dtype)
    up_projection = build_linear(linear_backend, torch.randn(shape.intermediate, shape.hidden, dtype=dtype))
    matmul_seconds = best_seconds(lambda: up_projection(x), repeats)
    kv_heads = max(1, shape.kv_dim // head_dim)
    q_heads = max(1, shape.q_dim // head_dim)
    layer_bytes_per_position = 2 * kv_heads * head_dim * torch.empty((), dtype=dtype).element_size()
    scan_rows = 8
    long_len = max(1024, (32 << 20) // (layer_bytes_per_position * scan_rows))
    short_len = long_len // 8
    k_cache = torch.randn(scan_rows * (long_len + 1), kv_heads, head_dim, dtype=dtype)
    v_cache = torch.randn_like(k_cache)
    req_to_token = torch.arange(scan_rows * (long_len + 1), dtype=torch.int64).view(scan_rows, long_len + 1)
    attention.warmup(q_heads, kv_heads, head_dim, dtype, torch.device("cpu"))
    q = torch.randn(scan_rows, q_heads, head_dim, dtype=dtype)

    def decode_seconds(context: int) -> float:
        batch = ForwardBatch.build([[0]] * scan_rows, [context] * scan_rows, list(range(scan_rows)),
                                   req_to_token[:, context], "cpu")
        meta = attention.prepare(batch, req_to_token)
        return best_seconds(lambda: attention.forward(q, k_cache, v_cache, meta), repeats)

    per_position = (decode_seconds(long_len) - decode_seconds(short_len)) / (scan_rows * (long_len - short_len))
    return MachineRates(
        matmul_flops_per_s=2 * rows * shape.hidden * shape.intermediate / max(matmul_seconds, 1e-9),
        kv_scan_bytes_per_s=layer_bytes_per_position / max(per_position, 1e-12),
    )
