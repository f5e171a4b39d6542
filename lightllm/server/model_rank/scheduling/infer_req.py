"""The inference-side view of one request.

An ``InferReq`` lives in the model-rank process.  It is plain Python so that the scheduling
core (classification, prefill-queue strategies, token accounting) and the scheduling simulator
can build and drive requests without shared memory, a model or torch.distributed.

Token bookkeeping
-----------------
``all_token_ids`` holds the prompt followed by every generated token.  ``cur_kv_len`` counts the
leading tokens of ``all_token_ids`` whose K/V already sit in the KV cache (prefix-cache hits and
earlier prefill chunks included).  The tokens still to be computed are
``all_token_ids[cur_kv_len:]``; a decode step computes exactly one of them.  ``kv_slot_len``
counts the leading positions that hold a KV slot: at least ``cur_kv_len``, more while slots are
reserved ahead of a forward (a step's chunk, or a decode node waiting for transferred KV).

Lifecycle
---------
``state`` is one :class:`~.request_state.ReqState`; :meth:`InferReq.move_to` is the only way to
change it and checks the transition (see ``request_state.py``).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Dict, List, Optional

from lightllm.server.model_rank.scheduling.overtake_record import OvertakeRecord
from lightllm.server.model_rank.scheduling.request_state import ReqState, check_transition

if TYPE_CHECKING:
    from lightllm.common.sampling.sampling_params import SamplingParams
    from lightllm.server.core.objs.request_spec import RequestSpec


@dataclass
class InferReq:
    """One request as the model backend schedules it.

    Attributes:
        request_id: unique id assigned by the HTTP process; the deterministic tie-breaker of
            every ordering decision (never wall clock), so all TP ranks agree.
        prompt_ids: prompt token ids.
        max_new_tokens: generation limit.
        arrival_processed_prefill_tokens: snapshot of the backend's processed-prefill-token
            counter when this request was created (HRRN aging measures from here).
        infer_high_priority: internal inference priority; negative means high.  Set only by the
            server itself (a PD master marks continuation segments), never from a public API field.
        generated_before: how many trailing prompt tokens earlier segments of the same generation
            produced (a PD continuation: prompt + output so far is the new prompt).  Sampling
            counts them as output (seeded step, output-token penalties, length-decay start) so
            the continuation samples exactly what the unsplit generation would.
        shm_index: slot of the shared-memory request record (``-1`` when there is none, e.g. in
            the simulator).
        req_row: row in the request manager's token table, ``-1`` until the request holds one.
        state: where the request is in its lifecycle; change it with :meth:`move_to`.
        strategy_state: metadata a prefill-queue strategy binds lazily to the request (the only
            request state a strategy may write), e.g. HRRN's fixed service cost.
        overtake: the overtaking bound's record (allowance, overtaken tokens, protected), bound
            the first time the request is ordered; written only by ``OvertakeBound``.
    """

    request_id: int
    prompt_ids: List[int]
    max_new_tokens: int = 16
    arrival_processed_prefill_tokens: int = 0
    infer_high_priority: int = 0
    generated_before: int = 0
    shm_index: int = -1
    req_row: int = -1
    output_ids: List[int] = field(default_factory=list)
    cur_kv_len: int = 0
    kv_slot_len: int = 0
    prompt_cache_len: int = 0
    # Whether its cached-token count is final: set when the request gives back KV it had computed
    # (RequestMembership._pause), as vLLM counts cache hits at a request's first scheduling only;
    # what it recomputes after that, partly from the cache, was counted (or computed) once already.
    cache_count_final: bool = False
    state: ReqState = ReqState.WAITING
    # Set by the client or by the rank; the step releases it at its start (never mid-forward).
    abort_requested: bool = False
    # A constrained request whose grammar compiles (from join) until rank 0 marks it ready on
    # every rank: no step plans it meanwhile, so no step waits for a compile (see step_engine.py).
    grammar_held: bool = False
    strategy_state: Dict[str, Any] = field(default_factory=dict)
    overtake: Optional[OvertakeRecord] = None
    sampling: Optional["SamplingParams"] = None
    # CLOCK_MONOTONIC ns when a step first selected the request (0: not yet), for the queue-time
    # metric; set and published by rank 0's rank process, never read by scheduling.
    scheduled_ns: int = 0
    # Next prompt position whose logprob is still to be computed (requests with prompt_logprobs).
    prompt_logprob_next: int = 1

    @classmethod
    def from_spec(
        cls, request_id: int, spec: "RequestSpec", *, shm_index: int = -1, arrival_processed_prefill_tokens: int = 0
    ) -> "InferReq":
        """The request ``spec`` describes, as the backend schedules it (the prompt copied into a list)."""
        return cls(
            request_id=request_id,
            prompt_ids=list(spec.prompt_ids),
            max_new_tokens=spec.params.max_new_tokens,
            arrival_processed_prefill_tokens=arrival_processed_prefill_tokens,
            infer_high_priority=spec.priority.infer_high_priority,
            generated_before=spec.segment.generated_before,
            shm_index=shm_index,
            sampling=spec.params,
        )

    def move_to(self, target: ReqState) -> None:
        """Change the lifecycle state; raises ``InvalidTransition`` for a move the lifecycle forbids."""
        check_transition(self.request_id, self.state, target)
        self.state = target

    @property
    def is_paused(self) -> bool:
        """Whether the request gave its KV back and waits to recompute."""
        return self.state is ReqState.PAUSED

    @property
    def wants_prompt_logprobs(self) -> bool:
        """Whether prompt logprobs were requested and some are still to be computed."""
        asked = self.sampling is not None and self.sampling.prompt_logprobs is not None
        return asked and self.prompt_logprob_next < self.input_len

    @property
    def cacheable_prefix_len(self) -> int:
        """Most leading tokens whose K/V may come from the prefix cache.

        All but the last token (one is always computed); for a request that still needs prompt
        logprobs none past the position whose logits predict its next missing one, since a
        cached position yields no logits.
        """
        limit = self.total_len - 1
        if self.wants_prompt_logprobs:
            limit = min(limit, self.prompt_logprob_next - 1)
        return limit

    @property
    def input_len(self) -> int:
        """Number of prompt tokens."""
        return len(self.prompt_ids)

    @property
    def total_len(self) -> int:
        """Prompt plus generated tokens so far."""
        return len(self.prompt_ids) + len(self.output_ids)

    @property
    def pending_token_num(self) -> int:
        """Tokens whose K/V are not yet in the cache (what a forward must still compute)."""
        # total_len spelled out: classification reads this for every live request twice a step.
        return len(self.prompt_ids) + len(self.output_ids) - self.cur_kv_len

    def token_at(self, position: int) -> int:
        """Token id at ``position`` of prompt + output."""
        if position < self.input_len:
            return self.prompt_ids[position]
        return self.output_ids[position - self.input_len]

    def token_slice(self, start: int, end: int) -> List[int]:
        """Token ids of prompt + output in ``[start, end)``."""
        if end <= self.input_len:
            return self.prompt_ids[start:end]
        if start >= self.input_len:  # a decode row: no copy of the prompt
            return self.output_ids[start - self.input_len : end - self.input_len]
        return (self.prompt_ids + self.output_ids)[start:end]
