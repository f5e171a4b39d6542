"""What one engine step produced, for the caller (rank process or simulator) to publish."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Dict, List, Optional, Tuple

from lightllm.server.model_rank.scheduling.infer_req import InferReq
from lightllm.server.model_rank.scheduling.model_executor import PromptLogprobEntry
from lightllm.server.model_rank.scheduling.step_planner import StepPlan


@dataclass
class StepReport:
    """The outcome of one step.

    Attributes:
        tokens: ``(request, token_id, logprob)`` in generation order: first the tokens requests
            received between steps (a decode node's first token, from the prefill node), then
            the ones this step sampled.
        carried_tokens: how many of the leading ``tokens`` were received between steps.
        top_logprobs: request id -> this step's ``(token_id, logprob)`` alternatives, most likely
            first, for requests that asked for them.
        prompt_logprobs: ``(request, [(position, logprob, top)])`` of prompt tokens this step
            computed.
        finished: requests that left with their finish status (already released).
        paused: requests whose KV was taken back this step.
        handoffs: requests whose prompt is done and whose KV now waits for a transfer to another
            node (PD prefill node only).
        prompt_cache_grown: requests whose ``prompt_cache_len`` grew this step (they took
            prompt tokens another request had computed meanwhile).
        ordered: this step's ready requests as offered to the planner: the decode ones in
            admission order, then the prefill ones in the strategy's order.
        plan: the planner's selection (None when nothing was ready).
        selected_ns: CLOCK_MONOTONIC ns when the plan was made, before its forwards (0: no plan);
            a request first selected this step was scheduled then (vLLM's queue time ends there).
        prefill_token_num / decode_batch_size: work submitted.
        forward_token_num: tokens the step's forwards took in: every prefill-chunk token plus one
            per decode row (a mixed batch's decode rows once), what vLLM's
            ``iteration_tokens_total`` histograms per step.
        schedule_seconds / forward_seconds / post_seconds: time per phase (forward time is
            virtual in the simulator).
    """

    tokens: List[Tuple[InferReq, int, float]] = field(default_factory=list)
    carried_tokens: int = 0
    top_logprobs: Dict[int, List[Tuple[int, float]]] = field(default_factory=dict)
    prompt_logprobs: List[Tuple[InferReq, List[PromptLogprobEntry]]] = field(default_factory=list)
    finished: List[Tuple[InferReq, int]] = field(default_factory=list)
    paused: List[InferReq] = field(default_factory=list)
    handoffs: List[InferReq] = field(default_factory=list)
    prompt_cache_grown: List[InferReq] = field(default_factory=list)
    ordered: List[InferReq] = field(default_factory=list)
    plan: Optional[StepPlan] = None
    selected_ns: int = 0
    prefill_token_num: int = 0
    decode_batch_size: int = 0
    forward_token_num: int = 0
    schedule_seconds: float = 0.0
    forward_seconds: float = 0.0
    post_seconds: float = 0.0

    @property
    def did_work(self) -> bool:
        """Whether any forward ran."""
        return self.prefill_token_num > 0 or self.decode_batch_size > 0

    @property
    def sampled(self) -> bool:
        """Whether this step's forward sampled a token (one received between steps does not count).

        Under TP, rank 0 then read on the host a result every rank's forward contributed to
        (see :mod:`lightllm.server.model_rank.record_read_fence`).
        """
        return len(self.tokens) > self.carried_tokens
