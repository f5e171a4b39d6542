"""The simulated server: the server's own router queue and mode backend, with forwards in virtual time.

One :class:`Simulator` stands for one server (router + one model rank).  Its step is:

1. router admission: each request is one ``RequestSpec``, as on a server; when its arrival time
   has come it joins the run mode's router queue (``build_req_queue(run_mode, ...)``: a
   ``NormalReqQueue`` on a normal or prefill node, a ``DecodeArrivalQueue`` on a decode node),
   whose ``admit_if_due`` (on the router's ``--router_max_wait_tokens`` cadence, counted in
   backend steps) moves those it admits into the running set.  Each gets the backend's
   ``InferReq`` (``new_request``) that joins the mode backend; on a decode node the backend's
   own ``reserve_prefilled`` takes it (its prompt KV and first token arrive in place) or refuses
   it busy, and the request is tried again after the PD master's busy-retry backoff
   (:meth:`Simulator._busy`);
2. ``backend.step()``: the server's own :class:`~lightllm.server.model_rank.scheduling.backend_registry.
   step_engine.StepEngine` (filter, resume, order, select, pause, execute, finish) built by
   ``build_backend(run_mode)``, over a :class:`TokenCountKvView` and a :class:`CostModelExecutor`;
3. the clock advances by the step's virtual forward time; the step's tokens are stamped with
   the time the step ends (the server publishes a step's tokens after the step); requests a
   prefill node handed off are acknowledged at once (KV transfer time is not modelled); finished
   requests leave the router's running set.

Only the executor (a cost model instead of a forward pass) and, by default, the KV view (a token
count instead of slots and a prefix cache) differ from a model rank.
"""

from __future__ import annotations

import heapq
from typing import Dict, List, Optional, Sequence, Set, Tuple, Union

from lightllm.benchmark.metrics import RequestRecord
from lightllm.benchmark.simulator.cost_executor import SAMPLED_TOKEN_ID, CostModelExecutor
from lightllm.benchmark.simulator.cost_model import CostProfile
from lightllm.benchmark.simulator.sim_types import SimArrival, SimResult, SimServerConfig, StepTrace
from lightllm.benchmark.workloads import ScheduledRequest
from lightllm.common.sampling import SamplingParams
from lightllm.server.core.objs.request_spec import RequestSpec
from lightllm.server.core.objs.shm_req_layout import PD_KIND_PREFILL
from lightllm.server.model_rank.scheduling.infer_req import InferReq
from lightllm.server.model_rank.scheduling.backend_registry import DecodeBackend, ModeBackend, PrefillBackend, build_backend
from lightllm.server.model_rank.scheduling.decode_backend import KvReservationRefused
from lightllm.server.model_rank.scheduling.kv_view import KvView, TokenCountKvView
from lightllm.server.model_rank.scheduling.prefill_queue_strategy import (
    PrefillQueueStrategy,
    build_prefill_queue_strategy,
)
from lightllm.server.model_rank.scheduling.processed_token_counter import ProcessedPrefillTokenCounter
from lightllm.server.model_rank.scheduling.step_planner import StepPlanner
from lightllm.server.pd.master.busy_retry import BusyRetryPolicy
from lightllm.server.router.req_queue.base_queue import ReqQueue
from lightllm.server.router.req_queue.queue_registry import build_req_queue
from lightllm.server.router.req_queue.router_req import RouterReq, reserved_new_tokens
from lightllm.utils.envs_utils import DEFAULT_PD_NODE_BUSY_RETRY_TIMEOUT_SECONDS

# Simulated requests have no per-request length cap beyond their own max_new_tokens.
_NO_TOTAL_LEN_LIMIT = 1 << 62


class Simulator:
    """One simulated server driving the real scheduling objects in virtual time.

    Args:
        profile: step-cost model and default KV capacity.
        strategy: a prefill-queue strategy instance (its own overtaking bound applies), or its
            registry name (built with ``config.overtake_bound``).
        config: server knobs (see :class:`SimServerConfig`).
        kv: the KV view the backend runs over; None: a :class:`TokenCountKvView` of the
            capacity, with ``running_max_req_size`` request rows as a model rank has.  A real
            ``InferenceContext`` (slots and the radix prefix cache) makes the run pay what a
            model rank pays for its KV bookkeeping (``schedule_cost``'s ``--kv-view radix``);
            the virtual clock is the same either way.
    """

    def __init__(
        self,
        profile: CostProfile,
        strategy: Union[str, PrefillQueueStrategy],
        config: SimServerConfig = SimServerConfig(),
        kv: Optional[KvView] = None,
    ) -> None:
        self.profile = profile
        if isinstance(strategy, str):
            strategy = build_prefill_queue_strategy(strategy, config.overtake_bound)
        if not isinstance(strategy, PrefillQueueStrategy):
            raise ValueError(f"strategy must be a name or a PrefillQueueStrategy, got {strategy!r}")
        self.strategy = strategy
        self.config = config
        capacity = config.max_total_token_num or profile.max_total_token_num
        self.planner = StepPlanner(config.batch_max_tokens, config.chunked_prefill_size, mixed=config.mixed_batches)
        self.router: ReqQueue = build_req_queue(
            config.run_mode,
            int(capacity * config.router_token_ratio),
            config.running_max_req_size,
            overtake_bound=config.overtake_bound,
        )
        self.capacity = capacity
        self.kv: KvView = TokenCountKvView(capacity, config.running_max_req_size) if kv is None else kv
        self.executor = CostModelExecutor(profile)
        self.backend: ModeBackend = build_backend(config.run_mode)(
            self.executor, self.kv, self.strategy, self.planner, [], _NO_TOTAL_LEN_LIMIT
        )
        self.clock = 0.0
        self.steps = 0
        # Every backend.step() call, as rank 0's ``backend_steps`` counter counts them (the
        # router's admission cadence); ``steps`` counts only those that ran a forward.
        self.backend_steps = 0
        self.paused_count = 0
        # A decode node's busy answers, as the PD master's busy-retry policy takes them (its
        # defaults; the server's LIGHTLLM_PD_NODE_BUSY_RETRY_TIMEOUT_SECONDS default).
        self.busy_policy = BusyRetryPolicy(timeout_s=DEFAULT_PD_NODE_BUSY_RETRY_TIMEOUT_SECONDS)
        self.busy_answers = 0
        # Request id -> (retry deadline, next backoff) of a request the decode node answered busy.
        self._busy_retry: Dict[int, Tuple[float, float]] = {}
        self._future: List[Tuple[float, int]] = []
        self._arrivals: Dict[int, SimArrival] = {}
        # Requests that reached the router and wait for admission, as the server holds them.
        self._specs: Dict[int, RequestSpec] = {}
        # One SamplingParams per output length, shared by its requests (nothing here mutates
        # them): validating a fresh one per request was a third of a short run's time.
        self._params: Dict[int, SamplingParams] = {}
        self._records: Dict[int, RequestRecord] = {}
        # Requests whose record was closed when they left between steps (reported again later).
        self._closed: Set[int] = set()

    @property
    def counter(self) -> ProcessedPrefillTokenCounter:
        """The backend's processed-prefill-token counter."""
        return self.backend.counter

    # --- input ---------------------------------------------------------------------------------
    def add_arrival(self, arrival: SimArrival) -> None:
        """Schedule a request; it reaches the router at ``arrival.arrival_s``."""
        if arrival.request_id in self._arrivals:
            raise ValueError(f"request_id {arrival.request_id} was already added")
        if arrival.prompt_len < 1 or arrival.output_len < 1:
            raise ValueError(
                f"prompt_len and output_len must be >= 1, got {arrival.prompt_len} and {arrival.output_len}"
            )
        if arrival.arrival_s < self.clock:
            raise ValueError(f"arrival_s ({arrival.arrival_s}) must not be before the clock ({self.clock})")
        if arrival.prompt_ids is not None and len(arrival.prompt_ids) != arrival.prompt_len:
            raise ValueError(
                f"prompt_ids holds {len(arrival.prompt_ids)} tokens but prompt_len is {arrival.prompt_len}"
            )
        self._arrivals[arrival.request_id] = arrival
        heapq.heappush(self._future, (arrival.arrival_s, arrival.request_id))
        self._records[arrival.request_id] = RequestRecord(
            index=arrival.request_id,
            request_class=arrival.request_class,
            prompt_tokens=arrival.prompt_len,
            scheduled_time=arrival.arrival_s,
            send_time=arrival.arrival_s,
            requested_output_tokens=arrival.output_len,
        )

    def add_workload(self, workload: Sequence[ScheduledRequest], first_request_id: int = 0) -> None:
        """Schedule a benchmark workload; request ids follow the workload order."""
        for offset, item in enumerate(workload):
            self.add_arrival(
                SimArrival(
                    request_id=first_request_id + offset,
                    arrival_s=item.scheduled_time_s,
                    prompt_len=item.prompt_len,
                    output_len=item.output_len,
                    request_class=item.request_class,
                )
            )

    # --- state ---------------------------------------------------------------------------------
    def live_requests(self) -> List[InferReq]:
        """Requests the backend holds, in admission order (what ``resume_paused`` iterates)."""
        return list(self.backend.requests.values())

    def unadmitted_count(self) -> int:
        """Requests still to arrive or waiting in the router queue."""
        return len(self._future) + len(self.router)

    def has_work(self) -> bool:
        """Whether any request is still to arrive, waiting for admission or running."""
        return bool(self._future or len(self.router) or self.backend.has_work)

    # --- the step ------------------------------------------------------------------------------
    def step(self) -> StepTrace:
        """Run one backend step (see the module docstring) and advance the virtual clock."""
        start = self.clock
        self._deliver_arrivals()
        self._admit()
        if not self.backend.has_work:
            self._wait_for_next_arrival()
            return StepTrace(start_s=start, end_s=self.clock)
        self.executor.last_prefill_seconds = self.executor.last_decode_seconds = 0.0
        self.backend_steps += 1
        report = self.backend.step()
        self.paused_count += len(report.paused)
        trace = StepTrace(start_s=start, end_s=start, ordered=report.ordered or None, plan=report.plan)
        if not report.did_work:
            # Requests paused just now gave KV back, so the next step can make progress.
            if not report.paused:
                self._wait_for_next_arrival()
            trace.end_s = self.clock
            return trace
        trace.prefill_seconds = self.executor.last_prefill_seconds
        trace.decode_seconds = self.executor.last_decode_seconds
        self.clock = start + report.forward_seconds
        self.steps += 1
        trace.end_s = self.clock
        # Tokens carried in from between steps (a decode node's handed-over token) were stamped at admission.
        for req, _, _ in report.tokens[report.carried_tokens:]:
            self._stamp_token(req)
        finished = [req for req in report.handoffs]
        for req in report.handoffs:
            # The decode node's acknowledgement, at once: the transfer is not modelled.
            assert isinstance(self.backend, PrefillBackend)
            self.backend.transfer_done(req.request_id, ok=True)
        finished.extend(req for req, _ in report.finished)
        trace.finished_ids = [req.request_id for req in finished if self._close(req)]
        return trace

    def run(self, max_steps: Optional[int] = None) -> SimResult:
        """Step until every request has finished (or ``max_steps`` steps ran); return the records."""
        if max_steps is not None and max_steps < 1:
            raise ValueError(f"max_steps must be None or >= 1, got {max_steps}")
        taken = 0
        while self.has_work() and (max_steps is None or taken < max_steps):
            self.step()
            taken += 1
        return self.result()

    def result(self) -> SimResult:
        """Records so far, in request-id order."""
        return SimResult(
            records=[self._records[key] for key in sorted(self._records)],
            steps=self.steps,
            end_s=self.clock,
            processed_prefill_tokens=self.counter.value,
            paused_count=self.paused_count,
        )

    # --- phases --------------------------------------------------------------------------------
    def _deliver_arrivals(self) -> None:
        future = self._future
        while future and future[0][0] <= self.clock:
            _, request_id = heapq.heappop(future)
            arrival = self._arrivals[request_id]
            # Built on arrival, not when scheduled: a soak run schedules hours of requests.
            params = self._params.get(arrival.output_len)
            if params is None:
                params = self._params[arrival.output_len] = SamplingParams(max_new_tokens=arrival.output_len,
                                                                           ignore_eos=True)
            prompt = arrival.prompt_ids if arrival.prompt_ids is not None else (SAMPLED_TOKEN_ID,) * arrival.prompt_len
            spec = RequestSpec(prompt, params)
            self._specs[request_id] = spec
            router_req = RouterReq.from_spec(request_id, -1, spec)
            if self.config.run_mode == "prefill":
                # The simulator's specs carry no PD placement: reserve what the server's router
                # reserves for a prefill node's request.
                router_req.max_new_tokens = reserved_new_tokens(spec.params.max_new_tokens, PD_KIND_PREFILL)
            self.router.append(router_req)

    def _admit(self) -> None:
        if not len(self.router):
            return  # nothing waits; admission would only re-sum the running set to return []
        backend = self.backend
        backend.observe_time(self.clock)  # a decode node's KV hold runs on the simulated clock
        for router_req in self.router.admit_if_due(self.backend_steps, self.config.router_max_wait_tokens):
            spec = self._specs.pop(router_req.request_id)
            if isinstance(backend, DecodeBackend):
                # Rank 0's reservation (DecodeRankTransfer.reserve); the KV transfer then lands the
                # whole prompt at once and the handed-over token is pending.
                try:
                    req = backend.reserve_prefilled(router_req.request_id, spec,
                                                    decode_tokens=backend.segment_tokens(spec.params.max_new_tokens))
                except KvReservationRefused:
                    self._busy(router_req.request_id)
                    continue
                self._busy_retry.pop(router_req.request_id, None)
                self._stamp_token_value(req)
                if backend.admit_prefilled(req, SAMPLED_TOKEN_ID):
                    self._close(req)
            else:
                backend.join(backend.new_request(router_req.request_id, spec))

    def _busy(self, request_id: int) -> None:
        """The decode node answered ``request_id`` busy: the PD master's busy-retry policy takes it.

        The request leaves the router's running set (the rank finishes it ``FINISH_BUSY``) and
        reaches the router again after the policy's backoff (its initial backoff, then
        ``multiplier`` times longer up to its largest, never past its deadline); once the
        deadline passed the master answers 503 ``server_busy``, and the record ends with that
        error.  The prefill node is not held back meanwhile (the simulated pair runs one node
        after the other; a real master reserves on the decode node before it asks the prefill
        node, so there the wait comes before the prefill).
        """
        self.busy_answers += 1
        self.router.release(request_id)
        policy = self.busy_policy
        deadline, backoff = self._busy_retry.get(request_id, (self.clock + policy.timeout_s, policy.initial_backoff_s))
        remaining = deadline - self.clock
        if policy.timeout_s == 0 or remaining <= 0:
            self._busy_retry.pop(request_id, None)
            self._records[request_id].error = "server_busy"
            self._closed.add(request_id)
            self._records[request_id].end_time = self.clock
            return
        self._busy_retry[request_id] = (deadline, policy.next_backoff(backoff))
        heapq.heappush(self._future, (self.clock + min(backoff, remaining), request_id))

    def _stamp_token_value(self, req: InferReq) -> None:
        """Record a token ``req`` receives outside a step (a decode node's handed-over token)."""
        record = self._records[req.request_id]
        record.first_token_time = self.clock
        if self.config.record_token_times:
            record.token_times.append(self.clock)
        record.output_tokens = 1

    def _stamp_token(self, req: InferReq) -> None:
        """Record the token ``req`` received this step at the current clock."""
        record = self._records[req.request_id]
        if record.first_token_time is None:
            record.first_token_time = self.clock
        if self.config.record_token_times:
            record.token_times.append(self.clock)
        record.output_tokens = len(req.output_ids)

    def _close(self, req: InferReq) -> bool:
        """Close the record of a request that left and free its router place (once)."""
        if req.request_id in self._closed:
            return False
        self._closed.add(req.request_id)
        self.router.release(req.request_id)
        self._records[req.request_id].end_time = self.clock
        return True

    def _wait_for_next_arrival(self) -> None:
        if self._future:
            self.clock = max(self.clock, self._future[0][0])
            return
        if self.backend.requests or len(self.router):
            raise RuntimeError(
                f"simulation stalled at t={self.clock:.6f}s: {len(self.backend.requests)} running and "
                f"{len(self.router)} waiting requests but nothing fits the KV cache "
                f"({self.kv.allocatable_token_num()} of {self.capacity} tokens free)"
            )
