"""What one model rank process needs to start: :class:`ModelRankConfig` (picklable for spawn).

Built by :mod:`lightllm.server.launch.plan` from the parsed flags, one per TP rank.
"""

from __future__ import annotations

import socket
from dataclasses import dataclass, field
from typing import List, Optional

from lightllm.common.sampling.logprobs_mode import DEFAULT_LOGPROBS_MODE
from lightllm.server.model_rank.scheduling.prefill_queue_strategy.overtake_bound import OvertakeBoundSpec
from lightllm.server.pd.transfer_defaults import (
    DEFAULT_PD_KV_PAGE_SIZE,
    DEFAULT_PD_TRANSFER_TIMEOUT_S,
    connect_timeout_for,
)
from lightllm.server.server_layout import ServerLayout
from lightllm.utils.envs_utils import DEFAULT_IDLE_MALLOC_TRIM_SECONDS, DEFAULT_WIDE_FORWARD_MS_PER_TOKEN


# The lease of a decode reservation that carries none (a master of an older version) on a node
# without --pd_reserve_lease_seconds: the flag's former default, so such a pair behaves as before.
DEFAULT_RESERVE_LEASE_S = 30.0


@dataclass
class PdRankSettings:
    """A PD rank's transfer settings, from the node's flags (used by :mod:`.pd_transfer`).

    Defined here, not beside the transfer code, because the launcher builds it and must not
    import the KV transfer (torch).  ``reserve_lease_s`` is ``--pd_reserve_lease_seconds``: an
    upper bound on every reservation's lease (None: no bound, the master's lease applies); see
    :meth:`lease_for`.
    """

    page_size: int = DEFAULT_PD_KV_PAGE_SIZE
    transfer_host: str = "127.0.0.1"  # prefill node: where its groups meet
    transfer_port: int = 0  # prefill node: rank r hosts at transfer_port + r
    transfer_timeout_s: float = DEFAULT_PD_TRANSFER_TIMEOUT_S
    connect_timeout_s: float = connect_timeout_for(DEFAULT_PD_TRANSFER_TIMEOUT_S)
    reserve_lease_s: Optional[float] = None
    max_segment_tokens: int = 0  # 0: no limit
    # Prefill node: LIGHTLLM_PD_TRANSFER_FAILURE_PROBABILITY (for tests), read once where the
    # launcher builds these settings, after its start-up check of the value (launch/plan.py
    # pd_rank_settings); a transfer process started later gets this value, not the variable's.
    transfer_failure_probability: float = 0.0
    # Prefill node: this rank's socket listening on transfer_port + rank, held by the node from
    # start-up (pd/node/transfer_ports.py); the rank serves its one transfer store on it, which every
    # pair's transfer processes join (pd/kv_transfer/store_host.py).
    listen_socket: Optional[socket.socket] = None

    def lease_for(self, requested_s: float) -> float:
        """The receive wait of a decode reservation whose master asked for ``requested_s`` (0: none).

        The master sends how long it is prepared to wait for the request's KV, so its own
        timeouts (with their error codes) fire first while it is alive, and a request queued on
        a busy prefill node keeps its reservation as long as the master keeps the request.  The
        node's flag, when set, bounds that; a reservation without a lease gets the flag, else
        :data:`DEFAULT_RESERVE_LEASE_S`.
        """
        cap = self.reserve_lease_s
        if requested_s > 0:
            return requested_s if cap is None else min(requested_s, cap)
        return DEFAULT_RESERVE_LEASE_S if cap is None else cap


@dataclass
class ModelRankConfig:
    """Everything a rank needs (picklable for spawn)."""

    rank: int
    # This process's name (its log, its heartbeat field): the launcher's, launch/plan.py child_process_names.
    process_name: str
    tp: int
    model_dir: str
    dtype: str
    device: str
    nccl_host: str
    nccl_port: int
    layout: ServerLayout
    running_max_req_size: int
    batch_max_tokens: int
    chunked_prefill_size: Optional[int]
    # Decode rows ride in the prefill forward (see model_rank/scheduling/step_planner.py); False with
    # --disable_mixed_batches or --disable_chunked_prefill.
    mixed_batches: bool
    prefill_queue_strategy: str
    prefill_overtake_bound: OvertakeBoundSpec
    use_prefix_cache: bool
    eos_token_ids: List[int]
    log_level: str
    # Seed of the generator unseeded requests sample from; the same on every TP rank, drawn fresh
    # at each start unless --sampling_seed fixes it (see launch/plan.py resolve_sampling_seed).
    sampling_seed: int
    # As requested (--attention_backend / --linear_backend, "auto" included): the rank resolves them
    # as it starts, since the launcher imports no torch. Required, as the run mode is: a default
    # here would be a second one beside the parser's.
    attention_backend: str
    linear_backend: str
    # --run_mode: "normal", or a PD node's "prefill" / "decode" (with the transfer settings).
    run_mode: str
    # --logprobs_mode: what returned logprobs describe (see common/sampling/logprobs_mode.py).
    logprobs_mode: str = DEFAULT_LOGPROBS_MODE
    torch_threads: Optional[int] = None  # short-context decode forwards and everything else
    # Threads a forward borrows when its estimated work is at least wide_forward_ms_per_token per
    # token it streams; None: torch_threads. See model_rank/execution/forward_threads.py.
    prefill_torch_threads: Optional[int] = None
    wide_forward_ms_per_token: float = DEFAULT_WIDE_FORWARD_MS_PER_TOKEN
    # Idle seconds before the rank returns freed heap memory to the kernel (inf: never).
    idle_malloc_trim_seconds: float = DEFAULT_IDLE_MALLOC_TRIM_SECONDS
    # Rank 0 writes a per-step trace here (LIGHTLLM_STEP_TRACE; None: no trace).
    step_trace_path: Optional[str] = None
    pd: PdRankSettings = field(default_factory=PdRankSettings)

    @property
    def max_req_total_len(self) -> int:
        """The layout's per-request token limit."""
        return self.layout.max_req_total_len

    @property
    def max_total_token_num(self) -> int:
        """The layout's KV-cache capacity in tokens."""
        return self.layout.max_total_token_num
