"""The waiting bound (``--prefill_max_wait_tokens``) holds for every registered strategy.

The proofs run the simulator, which drives the server's own router queue, strategies, waiting
bound, step planner and processed-prefill-token counter; only forwards are replaced by virtual
time.  The bound checked is the formula of ``docs/EN/prefill_queue_strategy.md``:

    wait(r) <= W + B + B * sum(ceil(P_q / C) for q in A(r))

where W = prefill_max_wait_tokens, B = batch_max_tokens, C = chunked_prefill_size, A(r) is r plus
every request the backend received before r that still had prompt tokens to prefill when r
arrived, and P_q those pending tokens.  wait(r) is measured on the counter clock, from r's
arrival snapshot to the counter value after the step that completed its prompt (or to now, for a
request still waiting when the run stops: a request stuck under sustained overload fails).
"""

from __future__ import annotations

import math
from typing import Dict, List, Tuple

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from lightllm.benchmark.simulator.cost_model import CostProfile
from lightllm.benchmark.simulator.engine import Simulator
from lightllm.benchmark.simulator.sim_types import SimArrival, SimServerConfig
from lightllm.server.router.model_infer.infer_req import InferReq
from lightllm.server.router.model_infer.mode_backend.prefill_queue_strategy import (
    available_strategy_names,
    build_prefill_queue_strategy,
)
from lightllm.server.router.model_infer.mode_backend.prefill_queue_strategy.waiting_bound import (
    PrefillWaitBound,
    check_max_wait_tokens,
)

STRATEGIES = available_strategy_names()

PROFILE = CostProfile(
    name="bound-test",
    prefill_fixed_s=0.001,
    prefill_per_token_s=1e-5,
    prefill_attention_s=0.0,
    decode_fixed_s=0.0005,
    decode_per_req_s=1e-6,
    decode_per_kv_token_s=0.0,
    max_total_token_num=1 << 22,
)


def step_seconds(budget: int) -> float:
    """Seconds one full prefill step of ``budget`` tokens takes under PROFILE."""
    return PROFILE.prefill_fixed_s + PROFILE.prefill_per_token_s * budget


class BoundChecker:
    """Drives a simulator step by step and checks the bound and its two mechanisms each step."""

    def __init__(self, sim: Simulator, budget: int, chunk: int, max_wait: int) -> None:
        self.sim, self.budget, self.chunk, self.max_wait = sim, budget, chunk, max_wait
        self.arrival: Dict[int, int] = {}
        self.limit: Dict[int, int] = {}
        self.done_at: Dict[int, int] = {}

    def step(self) -> None:
        sim = self.sim
        # Prompt tokens still to prefill of every request the backend holds before this step.
        older = {r.request_id: r.pending_token_num for r in sim.live_requests() if not r.output_ids}
        before = sim.counter.value
        trace = sim.step()
        if trace.ordered is None:
            return
        newcomers = [r for r in trace.ordered if r.request_id not in self.arrival]
        # Requests admitted in the same step count as older for each other (a looser bound).
        ahead_chunks = sum(math.ceil(p / self.chunk) for p in older.values())
        # A newcomer has prefilled nothing before this step (the simulator has no prefix cache).
        ahead_chunks += sum(math.ceil(r.input_len / self.chunk) for r in newcomers)
        for req in newcomers:
            assert req.arrival_processed_prefill_tokens == before
            self.arrival[req.request_id] = before
            self.limit[req.request_id] = self.max_wait + self.budget + self.budget * ahead_chunks
        # The step has advanced the requests already, so split by the plan, not by their state.
        decode_ids = {id(r) for r in trace.plan.decode_reqs + trace.plan.kv_starved_decode}
        prefill_order = [r for r in trace.ordered if id(r) not in decode_ids]
        self._check_order(prefill_order, before)
        self._check_head_served(trace.plan, prefill_order)
        for req in trace.ordered:
            if req.output_ids and req.request_id not in self.done_at:
                self.done_at[req.request_id] = sim.counter.value

    def _check_order(self, prefill: List[InferReq], counter: int) -> None:
        aged = [counter - r.arrival_processed_prefill_tokens > self.max_wait for r in prefill]
        # Aged requests first, none after a fresh one, and in arrival order among themselves.
        assert aged == sorted(aged, reverse=True)
        aged_arrivals = [r.arrival_processed_prefill_tokens for r, a in zip(prefill, aged) if a]
        assert aged_arrivals == sorted(aged_arrivals)

    def _check_head_served(self, plan, prefill_order: List[InferReq]) -> None:
        if prefill_order:
            # The head of the prefill order is never skipped for lack of budget.
            assert plan.prefill_chunks and plan.prefill_chunks[0].req is prefill_order[0]

    def check_bound(self) -> List[Tuple[int, int, int]]:
        """Assert every request's wait (finished or still waiting) is within its limit."""
        now = self.sim.counter.value
        waits = []
        for rid, arrival in self.arrival.items():
            wait = self.done_at.get(rid, now) - arrival
            assert wait <= self.limit[rid], f"request {rid} waited {wait} > bound {self.limit[rid]}"
            waits.append((rid, wait, self.limit[rid]))
        return waits


def run_checked(
    strategy: str, arrivals: List[SimArrival], budget: int, chunk: int, max_wait: int, max_steps: int, running_max: int = 256
) -> BoundChecker:
    config = SimServerConfig(
        batch_max_tokens=budget,
        chunked_prefill_size=chunk,
        running_max_req_size=running_max,
        prefill_max_wait_tokens=max_wait,
    )
    sim = Simulator(PROFILE, strategy, config)
    for arrival in arrivals:
        sim.add_arrival(arrival)
    checker = BoundChecker(sim, budget, chunk, max_wait)
    steps = 0
    while sim.has_work() and steps < max_steps:
        checker.step()
        steps += 1
    checker.check_bound()
    return checker


@st.composite
def arrival_streams(draw):
    """Random traffic: bursts, long prompts, and stretches of sustained overload."""
    budget = draw(st.sampled_from([64, 128, 256]))
    chunk = draw(st.sampled_from([budget, budget // 2]))
    max_wait = draw(st.sampled_from([budget // 2, budget, 4 * budget, 16 * budget]))
    count = draw(st.integers(min_value=1, max_value=60))
    # Mean gap below one step: arrivals outpace service, the backlog grows (overload).
    mean_gap = step_seconds(budget) * draw(st.sampled_from([0.0, 0.3, 0.8, 1.5]))
    arrivals = []
    clock = 0.0
    for request_id in range(count):
        clock += draw(st.floats(min_value=0.0, max_value=2 * mean_gap)) if mean_gap else 0.0
        long_prompt = draw(st.booleans())
        prompt = draw(st.integers(4 * budget, 16 * budget)) if long_prompt else draw(st.integers(1, budget))
        output = draw(st.integers(1, 4))
        arrivals.append(SimArrival(request_id, clock, prompt, output, "long" if long_prompt else "short"))
    return budget, chunk, max_wait, arrivals


@pytest.mark.parametrize("strategy", STRATEGIES)
@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(stream=arrival_streams(), running_max=st.sampled_from([3, 256]), max_steps=st.sampled_from([40, 400]))
def test_every_strategy_meets_the_bound_on_random_streams(strategy: str, stream, running_max: int, max_steps: int) -> None:
    budget, chunk, max_wait, arrivals = stream
    run_checked(strategy, arrivals, budget, chunk, max_wait, max_steps, running_max)


def sustained_overload(budget: int, long_len: int, short_len: int, rate_per_step: float, count: int) -> List[SimArrival]:
    """One long prompt, then short prompts at ``rate_per_step`` arrivals per full prefill step."""
    gap = step_seconds(budget) / rate_per_step
    arrivals = [SimArrival(0, 0.0, long_len, 1, "long")]
    arrivals += [SimArrival(i, 1e-4 + (i - 1) * gap, short_len, 2, "short") for i in range(1, count + 1)]
    return arrivals


@pytest.mark.parametrize("strategy", STRATEGIES)
@settings(max_examples=15, deadline=None)
@given(
    short_len=st.integers(min_value=100, max_value=256),
    rate_per_step=st.floats(min_value=0.9, max_value=3.0),
    max_wait=st.sampled_from([1024, 4096, 8192]),
)
def test_bound_holds_under_sustained_overload(strategy: str, short_len: int, rate_per_step: float, max_wait: int) -> None:
    # The starvation pattern: budget = chunk = 256, one 2048-token prompt, then a stream
    # of short prompts at one or more per step for longer than the run.
    arrivals = sustained_overload(256, 2048, short_len, rate_per_step, count=900)
    checker = run_checked(strategy, arrivals, 256, 256, max_wait, max_steps=300)
    assert 0 in checker.done_at, "the long prompt must get its first token within the run"
    assert checker.done_at[0] <= max_wait + 256 + 256 * 8


@pytest.mark.parametrize("strategy, short_len", [("promote_shortest", 256), ("promote_shortest", 200), ("hrrn", 256)])
def test_without_the_bound_the_seed_strategies_starve_the_long_prompt(strategy: str, short_len: int) -> None:
    # Shows the property tests can fail: with the bound disabled (0) the same stream keeps the
    # long prompt waiting far past what the bound of 8192 tokens allows.
    arrivals = sustained_overload(256, 2048, short_len, 1.0, count=900)
    config = SimServerConfig(batch_max_tokens=256, chunked_prefill_size=256, prefill_max_wait_tokens=0)
    sim = Simulator(PROFILE, strategy, config)
    for arrival in arrivals:
        sim.add_arrival(arrival)
    for _ in range(300):
        sim.step()
    long_record = sim.result().records[0]
    assert long_record.first_token_time is None or sim.counter.value > 8192 + 256 + 256 * 8
    bounded = run_checked(strategy, arrivals, 256, 256, 8192, max_steps=300)
    assert bounded.done_at[0] <= 8192 + 256 + 256 * 8


def test_wait_bound_orders_aged_requests_first_in_arrival_order() -> None:
    reqs = [
        InferReq(request_id=1, prompt_ids=[0] * 50, arrival_processed_prefill_tokens=900),
        InferReq(request_id=2, prompt_ids=[0] * 5000, arrival_processed_prefill_tokens=100),
        InferReq(request_id=3, prompt_ids=[0] * 10, arrival_processed_prefill_tokens=0),
        InferReq(request_id=4, prompt_ids=[0] * 20, arrival_processed_prefill_tokens=950),
    ]
    # hrrn alone would put the short, long-waiting request 3 first and request 2 last.
    assert [r.request_id for r in build_prefill_queue_strategy("hrrn", 0).reorder(reqs, 1000)][-1] == 2
    ordered = build_prefill_queue_strategy("hrrn", 500).reorder(reqs, 1000)
    assert [r.request_id for r in ordered][:2] == [3, 2]
    assert PrefillWaitBound(500).is_aged(reqs[1], 601) and not PrefillWaitBound(500).is_aged(reqs[1], 600)
    assert not PrefillWaitBound(0).is_aged(reqs[1], 10**9)


@pytest.mark.parametrize("bad", [-1, 1.5, True, "8"])
def test_bad_bound_is_rejected(bad) -> None:
    with pytest.raises(ValueError, match="prefill_max_wait_tokens"):
        check_max_wait_tokens(bad)
    with pytest.raises(ValueError, match="prefill_max_wait_tokens"):
        build_prefill_queue_strategy("default", bad)
    with pytest.raises(ValueError, match="prefill_max_wait_tokens"):
        SimServerConfig(prefill_max_wait_tokens=bad)
