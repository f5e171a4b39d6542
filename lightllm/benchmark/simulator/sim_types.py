"""Knobs, inputs and outputs of the simulated server (see :mod:`.engine` for the server itself)."""

from __future__ import annotations

import dataclasses
from typing import List, Optional, Tuple

from lightllm.benchmark.metrics import RequestRecord
from lightllm.server.model_rank.scheduling.infer_req import InferReq
from lightllm.server.model_rank.scheduling.backend_registry import BACKENDS
from lightllm.server.model_rank.scheduling.prefill_queue_strategy.overtake_bound import OvertakeBoundSpec
from lightllm.server.model_rank.scheduling.step_planner import StepPlan
from lightllm.server.router.req_queue.base_queue import DEFAULT_ROUTER_MAX_WAIT_TOKENS


@dataclasses.dataclass(frozen=True)
class SimServerConfig:
    """Server knobs the simulated scheduling depends on.

    Attributes:
        batch_max_tokens: most tokens one prefill forward computes (the prefill budget).
        chunked_prefill_size: largest chunk of one request per step; ``None`` disables chunking.
        running_max_req_size: most requests the router keeps running.
        max_total_token_num: KV capacity in tokens; ``None`` takes the profile's.
        router_token_ratio: router admission capacity as a share of the KV capacity, as the
            server's ``--router_token_ratio`` (above 1 over-commits and decode may run out of KV).
        run_mode: the node's mode backend (``build_backend``): ``normal``; ``prefill`` (a PD
            prefill node: nothing decodes and each request is handed off after its first token,
            its KV released once the transfer is acknowledged, which the simulator does at once);
            or ``decode`` (a PD decode node: requests arrive with their prompt's KV and first
            token in place and only decode here).
        record_token_times: keep every token's time (long soak runs turn it off to save memory).
        overtake_bound: the server's overtaking bound (``--prefill_max_overtake_tokens``,
            ``--prefill_overtake_fraction``) every strategy runs under, also at router admission.
            Used when the strategy is given by name.
        mixed_batches: decode rows ride in the prefill forward, sharing its budget and counted as
            submitted tokens (the server's default; ``--disable_mixed_batches`` turns it off).
            Off here by default: the H100 profile's costs were fitted to the seed's engine, which
            runs a step's prefill and decode as two forwards (docs/EN/simulator.md).
        router_max_wait_tokens: the server's ``--router_max_wait_tokens``: backend steps between
            two admission rounds while requests run (the router queue's own cadence,
            ``ReqQueue.admit_if_due``); by default the server's default
            (``DEFAULT_ROUTER_MAX_WAIT_TOKENS``).  A decode node's queue answers every arrival at
            once and ignores it.
    """

    batch_max_tokens: int = 1024
    chunked_prefill_size: Optional[int] = 1024
    running_max_req_size: int = 256
    max_total_token_num: Optional[int] = None
    router_token_ratio: float = 1.0
    run_mode: str = "normal"
    record_token_times: bool = True
    overtake_bound: OvertakeBoundSpec = OvertakeBoundSpec()
    mixed_batches: bool = False
    router_max_wait_tokens: int = DEFAULT_ROUTER_MAX_WAIT_TOKENS

    def __post_init__(self) -> None:
        if isinstance(self.router_max_wait_tokens, bool) or not isinstance(self.router_max_wait_tokens, int):
            raise ValueError(f"router_max_wait_tokens must be an int, got {self.router_max_wait_tokens!r}")
        if self.router_max_wait_tokens < 0:
            raise ValueError(f"router_max_wait_tokens must be >= 0, got {self.router_max_wait_tokens}")
        if not isinstance(self.overtake_bound, OvertakeBoundSpec):
            raise ValueError(f"overtake_bound must be an OvertakeBoundSpec, got {self.overtake_bound!r}")
        if isinstance(self.running_max_req_size, bool) or not isinstance(self.running_max_req_size, int):
            raise ValueError(f"running_max_req_size must be an int, got {self.running_max_req_size!r}")
        if self.running_max_req_size < 1:
            raise ValueError(f"running_max_req_size must be >= 1, got {self.running_max_req_size}")
        if self.max_total_token_num is not None and (
            isinstance(self.max_total_token_num, bool)
            or not isinstance(self.max_total_token_num, int)
            or self.max_total_token_num < 1
        ):
            raise ValueError(f"max_total_token_num must be None or an int >= 1, got {self.max_total_token_num!r}")
        if isinstance(self.router_token_ratio, bool) or not self.router_token_ratio > 0:
            raise ValueError(f"router_token_ratio must be > 0, got {self.router_token_ratio!r}")
        if self.run_mode not in BACKENDS:
            raise ValueError(f"run_mode must be one of {', '.join(BACKENDS)}, got {self.run_mode!r}")


@dataclasses.dataclass(frozen=True)
class SimArrival:
    """A request the simulated clients will send."""

    request_id: int
    arrival_s: float
    prompt_len: int
    output_len: int
    request_class: str
    # The prompt's token ids (``prompt_len`` of them); None: every token is the same id, which
    # is all a token-count KV view needs.  A run over a real prefix cache needs real prompts.
    prompt_ids: Optional[Tuple[int, ...]] = None


@dataclasses.dataclass
class StepTrace:
    """What one simulated step did (the objects are the simulator's own, not copies).

    ``ordered`` is the strategy's output and ``plan`` the planner's; both are ``None`` for an
    idle step in which the clock only jumped to the next arrival.
    """

    start_s: float
    end_s: float
    ordered: Optional[List[InferReq]] = None
    plan: Optional[StepPlan] = None
    prefill_seconds: float = 0.0
    decode_seconds: float = 0.0
    finished_ids: List[int] = dataclasses.field(default_factory=list)

    @property
    def idle(self) -> bool:
        """True when no forward ran."""
        return self.plan is None or (not self.plan.has_prefill and not self.plan.decode_reqs)


@dataclasses.dataclass
class SimResult:
    """Records of every request (virtual seconds) and run totals."""

    records: List[RequestRecord]
    steps: int
    end_s: float
    processed_prefill_tokens: int
    paused_count: int
