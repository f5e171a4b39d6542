"""How much memory the KV cache may take, with headroom that a shared machine survives.

The rule (docs/EN/memory.md explains it for operators)::

    kv_bytes = mem_fraction * (available - weights - reserve)

* ``available``: ``MemAvailable`` of ``/proc/meminfo`` on CPU (what the kernel can hand out
  without swapping, page cache included), free memory of the device on CUDA, read at start (by
  the device probe, :mod:`lightllm.server.launch.device_probe`: this module imports no torch).
* ``weights``: the checkpoint's tensors at the serving dtype; on CPU every rank's shard lives in
  the same memory, so all of it, on CUDA one rank's share.
* ``reserve`` (``--reserved_memory_gb``, or the estimate below): activations of the largest
  forward, and on CPU the server's child processes plus a tenth of the machine for everyone else.

On CPU the result is then split between the ranks and capped (``CPU_DEFAULT_KV_TOKEN_CAP``).
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Any, Optional

from lightllm.common.basemodel.kv_head_split import kv_heads_per_rank
from lightllm.common.basemodel.model_config import ModelConfig
from lightllm.common.basemodel.serving_dtype import dtype_itemsize
from lightllm.common.basemodel.safetensors_header import FLOAT_DTYPE_NAMES
from lightllm.common.basemodel.weight_headers import read_weight_headers

log = logging.getLogger("lightllm.kv_budget")

GIB = 1 << 30
# Router and detokenization start next to the ranks after memory is read (the HTTP process already
# runs, so it is counted as used). Measured RSS (without KV) with the small demo model: 0.3 GiB for
# a rank, most of it torch; under 0.1 GiB for the router and the detokenizer, which load no torch.
SERVER_SIDE_CHILDREN = 2
PROCESS_ALLOWANCE_BYTES = GIB // 2
# Left to the rest of a shared CPU machine: the OS, page cache and other services keep working.
CPU_MACHINE_SHARE = 0.10
# CUDA context, library workspaces and captured graphs on each device.
CUDA_CONTEXT_BYTES = GIB
# Allocator slack on top of the live activation estimate (freed blocks not yet reused).
ACTIVATION_SLACK = 2


@dataclass(frozen=True)
class ActivationEstimate:
    """One rank's transient memory in its largest forward, by the flag that drives each term (bytes, slack included)."""

    # The prefill tokens of one forward: --batch_max_tokens (by default from --chunked_prefill_size).
    hidden: int
    # Sampled rows: --running_max_req_size.
    logits: int
    # One chunk's attention scores against the longest context: --chunked_prefill_size x --max_req_total_len.
    scores: int
    # A PD decode node's estimate: its largest forward is a decode step, whose rows
    # (--running_max_req_size) drive the token and score terms.
    decode_node: bool = False

    @property
    def total(self) -> int:
        """The whole estimate."""
        return self.hidden + self.logits + self.scores

    def largest_driver(self, chunked: bool = True) -> str:
        """The flags behind the largest term, as an operator would lower them (``chunked`` False:
        --disable_chunked_prefill, where a prompt runs whole and no chunk size can be lowered)."""
        if self.decode_node:
            terms = {"--running_max_req_size": self.hidden + self.logits,
                     "--running_max_req_size or --max_req_total_len": self.scores}
        elif not chunked:
            terms = {
                # Whole prompts: --batch_max_tokens may not go below --max_req_total_len.
                "--max_req_total_len (with --disable_chunked_prefill a prompt runs whole; --batch_max_tokens "
                "follows it)": self.hidden + self.scores,
                "--running_max_req_size": self.logits,
            }
        else:
            terms = {
                "--batch_max_tokens / --chunked_prefill_size": self.hidden,
                "--running_max_req_size": self.logits,
                "--chunked_prefill_size or --max_req_total_len": self.scores,
            }
        return max(terms, key=terms.__getitem__)


@dataclass(frozen=True)
class KVBudget:
    """The terms of the rule above, in bytes, for the start-up log and the docs."""

    available: int
    weights: int
    reserve: int
    mem_fraction: float
    # The reserve's estimated activations across this machine's ranks (None when
    # --reserved_memory_gb gave the reserve).
    activations: Optional[ActivationEstimate] = None
    ranks_here: int = 1

    @property
    def activation_share(self) -> float:
        """The fraction of the reserve that the activation estimate makes up (0 without one)."""
        if self.activations is None or self.reserve <= 0:
            return 0.0
        return self.ranks_here * self.activations.total / self.reserve

    @property
    def kv_bytes(self) -> int:
        """Memory the KV cache may take (0 when the reserve and weights already exceed what is available)."""
        return max(0, int(self.mem_fraction * (self.available - self.weights - self.reserve)))

    def describe(self) -> str:
        """One line: every term in GiB."""
        return (
            f"KV budget {self.kv_bytes / GIB:.2f} GiB = {self.mem_fraction} x (available {self.available / GIB:.2f} "
            f"- weights {self.weights / GIB:.2f} - reserve {self.reserve / GIB:.2f}) GiB"
        )


def available_memory_bytes(device: str, cuda_free_bytes: Optional[int] = None) -> int:
    """Free device memory on CUDA (``cuda_free_bytes``, which the device probe measured);
    ``MemAvailable`` on CPU (4 GiB when it cannot be read)."""
    if device == "cuda":
        if cuda_free_bytes is None:
            raise ValueError("the free memory of the CUDA device is unknown (the device probe did not report it)")
        return int(cuda_free_bytes)
    return _meminfo_bytes("MemAvailable") or 4 * GIB


def kv_bytes_per_token(num_layers: int, kv_heads: int, head_dim: int, dtype: Any) -> int:
    """Memory one token slot takes across all layers, K and V (``dtype``: a name or torch dtype).

    The same number as ``KVCacheMemoryManager.bytes_per_token``, without torch.
    """
    return 2 * num_layers * kv_heads * head_dim * dtype_itemsize(dtype)


def _meminfo_bytes(field: str) -> int:
    try:
        with open("/proc/meminfo") as handle:
            for line in handle:
                if line.startswith(field + ":"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return 0


def weights_bytes(model_dir: str, serving_dtype: Any) -> int:
    """Size of the checkpoint's tensors once loaded at ``serving_dtype`` (a name or torch dtype).

    Counted from the safetensors headers (never the tensor data): each floating tensor at
    ``serving_dtype``, any other as stored.  config.json's dtype is not asked: it may name none,
    one this server does not run, or another than the weights'.
    """
    size = dtype_itemsize(serving_dtype)
    total = 0
    for header in read_weight_headers(model_dir).values():
        for entry in header.tensors.values():
            stored = entry.end - entry.begin
            if entry.dtype in FLOAT_DTYPE_NAMES:
                elements = 1
                for dim in entry.shape:
                    elements *= dim
                total += elements * size
            else:
                total += stored
    return total


def replicated_kv_weight_bytes(config: ModelConfig, tp: int, serving_dtype: Any) -> int:
    """The k/v projection weights the ranks hold beyond the checkpoint's when ``tp`` exceeds the KV
    heads and each rank keeps a replica of one (biases are negligible and left out)."""
    extra_heads = tp * kv_heads_per_rank(config.num_key_value_heads, tp) - config.num_key_value_heads
    per_head = 2 * config.head_dim * config.hidden_size * dtype_itemsize(serving_dtype)  # k and v rows
    return config.num_hidden_layers * extra_heads * per_head


def activation_bytes(
    config: ModelConfig, tp: int, batch_max_tokens: int, chunk_tokens: int, max_req_total_len: int, max_batch_rows: int
) -> int:
    """:func:`activation_estimate`'s total."""
    return activation_estimate(config, tp, batch_max_tokens, chunk_tokens, max_req_total_len, max_batch_rows).total


def activation_estimate(
    config: ModelConfig, tp: int, batch_max_tokens: int, chunk_tokens: int, max_req_total_len: int, max_batch_rows: int,
    decode_node: bool = False,
) -> ActivationEstimate:
    """Generous estimate of one rank's transient memory in its largest forward (float32 throughout).

    Per token of a prefill: the residual stream and its normed copies, q/k/v and the attention
    output, the MLP's gate/up/activation.  Per sampled row: logits and the sampler's copies.
    Attention of one masked chunk against the longest context materialises scores and their
    softmax (the torch path on CPU).  Doubled for allocator slack.  A decode node
    (``decode_node``) passes its decode step's rows as both the tokens and the chunk: one query
    token per row, each against up to the longest context.
    """
    floats_per_token = (
        8 * config.hidden_size
        + (config.num_attention_heads // tp + 2 * kv_heads_per_rank(config.num_key_value_heads, tp)) * config.head_dim
        + 3 * config.intermediate_size // tp
    )
    hidden = batch_max_tokens * floats_per_token * 4
    logits = max_batch_rows * config.vocab_size * 4 * 4
    scores = 2 * (config.num_attention_heads // tp) * min(chunk_tokens, batch_max_tokens) * max_req_total_len * 4
    return ActivationEstimate(ACTIVATION_SLACK * hidden, ACTIVATION_SLACK * logits, ACTIVATION_SLACK * scores,
                              decode_node)


def plan_kv_budget(
    *,
    device: str,
    config: ModelConfig,
    model_dir: str,
    serving_dtype: Any,
    tp: int,
    mem_fraction: float,
    reserved_memory_gb: float | None,
    batch_max_tokens: int,
    chunk_tokens: int,
    max_req_total_len: int,
    max_batch_rows: int,
    cuda_free_bytes: Optional[int] = None,
    decode_node: bool = False,
) -> KVBudget:
    """Apply the rule of this module; the caller turns bytes into tokens.

    ``serving_dtype``: a name or torch dtype; ``cuda_free_bytes``: the device's free memory on CUDA.
    """
    weights = weights_bytes(model_dir, serving_dtype)
    weights += replicated_kv_weight_bytes(config, tp, serving_dtype)
    if device == "cpu":
        ranks_here = tp  # every rank shares the machine's memory
    else:
        weights //= tp  # one rank per device
        ranks_here = 1
    activations = None
    if reserved_memory_gb is not None:
        reserve = int(reserved_memory_gb * GIB)
    else:
        activations = activation_estimate(config, tp, batch_max_tokens, chunk_tokens, max_req_total_len, max_batch_rows,
                                          decode_node)
        reserve = ranks_here * activations.total
        if device == "cpu":
            reserve += (SERVER_SIDE_CHILDREN + tp) * PROCESS_ALLOWANCE_BYTES
            reserve += int(CPU_MACHINE_SHARE * _meminfo_bytes("MemTotal"))
        else:
            reserve += CUDA_CONTEXT_BYTES
    budget = KVBudget(
        available_memory_bytes(device, cuda_free_bytes), weights, reserve, mem_fraction, activations, ranks_here
    )
    log.info("%s", budget.describe())
    return budget
