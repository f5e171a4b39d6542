"""The simulated server: real admission and scheduling code, forwards replaced by virtual time.

One :class:`Simulator` stands for one server (router + one model rank).  Its :meth:`step`
follows the model backend's step (``ModeBackend.step`` in ``base_backend.py``) call for call:

1. router admission: requests whose arrival time has come join ``NormalReqQueue``; ``admit()``
   moves those that fit into the running set and each gets an ``InferReq`` that snapshots the
   ``ProcessedPrefillTokenCounter``;
2. finished requests are already gone (released the moment they finish, as in the server);
3. paused requests resume once the free KV could hold them;
4. ``strategy.reorder(ready, counter.value)`` -- the real prefill-queue strategy;
5. ``planner.plan(ordered, free_kv)`` -- the real ``StepPlanner``;
6. decode requests left without KV are paused (their KV is given back);
7. prefill forward: KV allocated, ``submit_prefill`` advances the counter, chunks advance
   ``cur_kv_len`` and requests whose chunk completes the prompt sample their first token;
8. decode forward: one token for each decode request;
9. requests that reached ``max_new_tokens`` (or, with ``no_decode``, got their first token)
   finish, release their KV and leave the router's running set.

Only steps 7 and 8 differ from the server: instead of running the model they advance the
virtual clock by the :class:`CostProfile` duration.  Tokens a step produces are stamped with
the time the step ends, because the server publishes a step's tokens after the step.
"""

from __future__ import annotations

import heapq
from typing import Dict, List, Optional, Sequence, Tuple, Union

from lightllm.benchmark.metrics import RequestRecord
from lightllm.benchmark.simulator.cost_model import CostProfile
from lightllm.benchmark.simulator.kv_pool import KvTokenPool
from lightllm.benchmark.simulator.sim_types import SimArrival, SimResult, SimServerConfig, StepTrace
from lightllm.benchmark.workloads import ScheduledRequest
from lightllm.server.router.model_infer.infer_req import InferReq
from lightllm.server.router.model_infer.mode_backend.prefill_queue_strategy import (
    PrefillQueueStrategy,
    build_prefill_queue_strategy,
)
from lightllm.server.router.model_infer.mode_backend.processed_token_counter import ProcessedPrefillTokenCounter
from lightllm.server.router.model_infer.mode_backend.step_planner import StepPlan, StepPlanner, submit_prefill
from lightllm.server.router.req_queue.normal_queue import NormalReqQueue, RouterReq

# The simulator never looks at token values; every sampled token is this id.
SAMPLED_TOKEN_ID = 0


class Simulator:
    """One simulated server driving the real scheduling objects in virtual time.

    Args:
        profile: step-cost model and default KV capacity.
        strategy: a prefill-queue strategy instance (its own waiting bound applies), or its
            registry name (built with ``config.prefill_max_wait_tokens``).
        config: server knobs (see :class:`SimServerConfig`).
    """

    def __init__(
        self,
        profile: CostProfile,
        strategy: Union[str, PrefillQueueStrategy],
        config: SimServerConfig = SimServerConfig(),
    ) -> None:
        self.profile = profile
        if isinstance(strategy, str):
            strategy = build_prefill_queue_strategy(strategy, config.prefill_max_wait_tokens)
        self.strategy = strategy
        if not isinstance(self.strategy, PrefillQueueStrategy):
            raise ValueError(f"strategy must be a name or a PrefillQueueStrategy, got {strategy!r}")
        self.config = config
        capacity = config.max_total_token_num or profile.max_total_token_num
        self.planner = StepPlanner(config.batch_max_tokens, config.chunked_prefill_size)
        self.counter = ProcessedPrefillTokenCounter()
        self.router = NormalReqQueue(
            int(capacity * config.router_token_ratio),
            config.running_max_req_size,
            max_wait_tokens=config.prefill_max_wait_tokens,
        )
        self.kv = KvTokenPool(capacity)
        self.clock = 0.0
        self.steps = 0
        self.paused_count = 0
        self._future: List[Tuple[float, int]] = []
        self._arrivals: Dict[int, SimArrival] = {}
        self._live: Dict[int, InferReq] = {}
        self._records: Dict[int, RequestRecord] = {}

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
        return list(self._live.values())

    def unadmitted_count(self) -> int:
        """Requests still to arrive or waiting in the router queue."""
        return len(self._future) + len(self.router)

    def has_work(self) -> bool:
        """Whether any request is still to arrive, waiting for admission or running."""
        return bool(self._future or len(self.router) or self._live)

    # --- the step ------------------------------------------------------------------------------
    def step(self) -> StepTrace:
        """Run one backend step (see the module docstring) and advance the virtual clock."""
        start = self.clock
        self._deliver_arrivals()
        self._admit()
        ready = self._resume_paused()
        if not ready:
            self._wait_for_next_arrival()
            return StepTrace(start_s=start, end_s=self.clock)
        no_decode = self.config.no_decode
        ordered = self.strategy.reorder(ready, self.counter.value, no_decode=no_decode)
        plan = self.planner.plan(ordered, self.kv.free_tokens, no_decode=no_decode)
        self._pause_starved(plan)
        trace = StepTrace(start_s=start, end_s=start, ordered=ordered, plan=plan)
        if trace.idle:
            # Requests paused just now gave KV back, so the next step can make progress.
            if not plan.kv_starved_decode:
                self._wait_for_next_arrival()
            trace.end_s = self.clock
            return trace
        emitted: List[InferReq] = []
        if plan.has_prefill:
            trace.prefill_seconds = self._run_prefill(plan, emitted)
        if plan.decode_reqs:
            trace.decode_seconds = self._run_decode(plan.decode_reqs, emitted)
        self.clock = start + trace.prefill_seconds + trace.decode_seconds
        self.steps += 1
        trace.end_s = self.clock
        trace.finished_ids = self._publish(emitted)
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
            # A decode node is handed the prompt plus the first token; a prefill node produces one.
            if self.config.no_decode:
                max_new_tokens = 1
            else:
                max_new_tokens = arrival.output_len
            self.router.append(
                RouterReq(
                    request_id=request_id,
                    shm_index=-1,
                    input_len=arrival.prompt_len,
                    max_new_tokens=max_new_tokens,
                )
            )

    def _admit(self) -> None:
        if not len(self.router):
            return  # nothing waits; admit() would only re-sum the running set to return []
        for router_req in self.router.admit():
            arrival = self._arrivals[router_req.request_id]
            req = InferReq(
                request_id=arrival.request_id,
                prompt_ids=[SAMPLED_TOKEN_ID] * arrival.prompt_len,
                max_new_tokens=router_req.max_new_tokens,
                arrival_processed_prefill_tokens=self.counter.snapshot(),
            )
            self._live[req.request_id] = req
            if self.config.arrive_prefilled:
                # The KV transfer lands the whole prompt; the handed-over token is pending.
                self.kv.alloc(arrival.prompt_len)
                req.cur_kv_len = arrival.prompt_len
                self._stamp_token(req)
                if len(req.output_ids) >= req.max_new_tokens:
                    self._finish(req)

    def _resume_paused(self) -> List[InferReq]:
        ready: List[InferReq] = []
        for req in self._live.values():
            if req.paused:
                # Without a prefix cache a paused request recomputes everything it holds.
                if self.kv.free_tokens() < req.total_len:
                    continue
                req.paused = False
            ready.append(req)
        return ready

    def _pause_starved(self, plan: StepPlan) -> None:
        for req in plan.kv_starved_decode:
            self.kv.free(req.cur_kv_len)
            req.cur_kv_len = 0
            req.paused = True
            self.paused_count += 1

    def _run_prefill(self, plan: StepPlan, emitted: List[InferReq]) -> float:
        chunks = plan.prefill_chunks
        self.kv.alloc(sum(chunk.token_num for chunk in chunks))
        submit_prefill(plan, self.counter)
        seconds = self.profile.prefill_seconds([(chunk.token_num, chunk.end) for chunk in chunks])
        for chunk in chunks:
            req = chunk.req
            req.cur_kv_len = chunk.end
            if chunk.end == req.total_len:
                emitted.append(req)
        return seconds

    def _run_decode(self, reqs: List[InferReq], emitted: List[InferReq]) -> float:
        self.kv.alloc(len(reqs))
        kv_sum = 0
        for req in reqs:
            req.cur_kv_len += 1
            kv_sum += req.cur_kv_len
            emitted.append(req)
        return self.profile.decode_seconds(len(reqs), kv_sum)

    def _publish(self, emitted: List[InferReq]) -> List[int]:
        """Append the sampled tokens, stamp them with the step's end, finish whoever is done."""
        finished: List[int] = []
        for req in emitted:
            self._stamp_token(req)
            if self.config.no_decode or len(req.output_ids) >= req.max_new_tokens:
                self._finish(req)
                finished.append(req.request_id)
        return finished

    def _stamp_token(self, req: InferReq) -> None:
        """Give ``req`` one sampled token and record it at the current clock."""
        req.output_ids.append(SAMPLED_TOKEN_ID)
        record = self._records[req.request_id]
        if record.first_token_time is None:
            record.first_token_time = self.clock
        if self.config.record_token_times:
            record.token_times.append(self.clock)
        record.output_tokens = len(req.output_ids)

    def _finish(self, req: InferReq) -> None:
        req.finished = True
        self.kv.free(req.cur_kv_len)
        req.cur_kv_len = 0
        del self._live[req.request_id]
        self.router.release(req.request_id)
        self._records[req.request_id].end_time = self.clock

    def _wait_for_next_arrival(self) -> None:
        if self._future:
            self.clock = max(self.clock, self._future[0][0])
            return
        if self._live or len(self.router):
            raise RuntimeError(
                f"simulation stalled at t={self.clock:.6f}s: {len(self._live)} running and "
                f"{len(self.router)} waiting requests but nothing fits the KV cache "
                f"({self.kv.free_tokens()} of {self.kv.capacity} tokens free)"
            )
