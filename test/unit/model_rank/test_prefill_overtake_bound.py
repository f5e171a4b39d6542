"""The overtaking bound holds for every registered strategy.

The proofs run the simulator, which drives the server's own router queue, strategies, bound,
step planner and processed-prefill-token counter; only forwards are replaced by virtual time.
The checker recomputes everything from the steps' plans itself (it never reads the bound's own
records), so a bound that protected too late or pulled requests forward wrongly would fail it.
The formula checked is the one of ``docs/EN/prefill_queue_strategy.md``:

    overtaken(r) <= W0 + floor(e * A(r)) + B + (C - 1) * sum(ceil(P_q / C) for q in H(r))

where W0 = prefill_max_overtake_tokens, e = prefill_overtake_fraction, B = batch_max_tokens,
C = chunked_prefill_size, A(r) the prompt tokens pending ahead of r in default's order when it
arrived (its FCFS wait), H(r) those requests and P_q their pending tokens.  overtaken(r) counts,
over the steps that gave r no chunk, the tokens they gave to requests default puts behind r.
Under ``default`` the same sum holds without the first three terms: the last one is the planner
filling budget a skipped chunk leaves, which first-come-first-served has too.
"""

from __future__ import annotations

import math
from typing import Dict, List, Tuple

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from bound_test_support import BOUND_TEST_PROFILE
from lightllm.benchmark.simulator.engine import Simulator
from lightllm.benchmark.simulator.sim_types import SimArrival, SimServerConfig
from lightllm.server.model_rank.scheduling.infer_req import InferReq
from lightllm.server.model_rank.scheduling.prefill_queue_strategy import (
    available_strategy_names,
    build_prefill_queue_strategy,
)
from lightllm.server.model_rank.scheduling.prefill_queue_strategy.overtake_bound import OvertakeBoundSpec
from lightllm.server.model_rank.scheduling.processed_token_counter import ProcessedPrefillTokenCounter
from lightllm.server.model_rank.scheduling.request_classifier import NO_DECODE_CLASSIFIER
from lightllm.server.model_rank.scheduling.step_planner import StepPlanner, submit_prefill

STRATEGIES = available_strategy_names()

PROFILE = BOUND_TEST_PROFILE


def step_seconds(budget: int) -> float:
    """Seconds one full prefill step of ``budget`` tokens takes under PROFILE."""
    return PROFILE.prefill_fixed_s + PROFILE.prefill_per_token_s * budget


class RegretChecker:
    """Drives a simulator step by step and recomputes every request's overtaken tokens."""

    def __init__(self, sim: Simulator, spec: OvertakeBoundSpec, budget: int, chunk: int) -> None:
        self.sim, self.spec, self.budget, self.chunk = sim, spec, budget, chunk
        self.seq: Dict[int, int] = {}
        self.ahead: Dict[int, int] = {}
        self.ahead_chunks: Dict[int, int] = {}
        self.overtaken: Dict[int, int] = {}
        self.arrival_clock: Dict[int, int] = {}
        self.done_clock: Dict[int, int] = {}
        self.prompt: Dict[int, int] = {}

    def key(self, req: InferReq) -> Tuple[int, int]:
        return (req.infer_high_priority, self.seq[req.request_id])

    def step(self) -> None:
        sim = self.sim
        # Prompt tokens still to prefill of every waiting request the backend holds before the
        # step; the step admits newcomers itself, after them in admission (request id) order.
        pending_before = [(r, r.pending_token_num) for r in sim.live_requests() if not r.output_ids]
        clock_before = sim.counter.value
        trace = sim.step()
        if trace.ordered is None:
            return
        newcomers = sorted((r for r in trace.ordered if r.request_id not in self.seq), key=lambda r: r.request_id)
        # A newcomer has prefilled nothing before this step (the simulator has no prefix cache).
        pending_before += [(r, r.input_len) for r in newcomers]
        for req in newcomers:
            self.seq[req.request_id] = len(self.seq)
            self.arrival_clock[req.request_id] = clock_before
            self.prompt[req.request_id] = req.input_len
        for req in newcomers:
            before = [p for q, p in pending_before if self.key(q) < self.key(req)]
            self.ahead[req.request_id] = sum(before)
            self.ahead_chunks[req.request_id] = sum(math.ceil(p / self.chunk) for p in before)
            self.overtaken[req.request_id] = 0
        if trace.plan is None or not trace.plan.prefill_chunks:
            return
        served = [(self.key(c.req), c.token_num) for c in trace.plan.prefill_chunks]
        served_ids = {id(c.req) for c in trace.plan.prefill_chunks}
        for req in trace.plan.skipped:
            if id(req) not in served_ids:
                self.overtaken[req.request_id] += sum(t for k, t in served if k > self.key(req))
        for chunk in trace.plan.prefill_chunks:
            if chunk.req.output_ids and chunk.req.request_id not in self.done_clock:
                self.done_clock[chunk.req.request_id] = sim.counter.value

    def limit(self, rid: int, strategy: str) -> int:
        """The formula's right-hand side for request ``rid``."""
        fill = (self.chunk - 1) * self.ahead_chunks[rid]
        if strategy == "default" or not self.spec.enabled:
            return fill if strategy == "default" else 1 << 62
        return self.spec.allowance(self.ahead[rid]) + self.budget + fill

    def check(self, strategy: str) -> None:
        for rid, overtaken in self.overtaken.items():
            limit = self.limit(rid, strategy)
            assert overtaken <= limit, f"request {rid} was overtaken by {overtaken} > bound {limit}"
            # The corollary on the counter clock: its wait is its FCFS wait, its own prompt, what
            # overtook it, and what later work got beside its own chunks.
            if rid in self.done_clock:
                wait = self.done_clock[rid] - self.arrival_clock[rid]
                beside = (self.budget - 1) * math.ceil(self.prompt[rid] / self.chunk)
                assert wait <= self.ahead[rid] + self.prompt[rid] + overtaken + beside


def run_checked(
    strategy: str,
    arrivals: List[SimArrival],
    budget: int,
    chunk: int,
    spec: OvertakeBoundSpec,
    max_steps: int,
    running_max: int = 256,
) -> RegretChecker:
    config = SimServerConfig(
        batch_max_tokens=budget, chunked_prefill_size=chunk, running_max_req_size=running_max, overtake_bound=spec
    )
    sim = Simulator(PROFILE, strategy, config)
    for arrival in arrivals:
        sim.add_arrival(arrival)
    checker = RegretChecker(sim, spec, budget, chunk)
    steps = 0
    while sim.has_work() and steps < max_steps:
        checker.step()
        steps += 1
    checker.check(strategy)
    return checker


@st.composite
def arrival_streams(draw):
    """Random traffic: bursts, long prompts, and stretches of sustained overload."""
    budget = draw(st.sampled_from([64, 128, 256]))
    chunk = draw(st.sampled_from([budget, budget // 2]))
    spec = OvertakeBoundSpec(
        draw(st.sampled_from([0, budget // 2, 4 * budget, 16 * budget])), draw(st.sampled_from([0.0, 0.1, 0.5]))
    )
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
    return budget, chunk, spec, arrivals


@pytest.mark.parametrize("strategy", STRATEGIES)
@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(stream=arrival_streams(), running_max=st.sampled_from([3, 256]), max_steps=st.sampled_from([40, 400]))
def test_every_strategy_meets_the_bound_on_random_streams(strategy: str, stream, running_max: int, max_steps: int) -> None:
    budget, chunk, spec, arrivals = stream
    run_checked(strategy, arrivals, budget, chunk, spec, max_steps, running_max)


def long_then_stream(budget: int, long_len: int, short_len: int, rate_per_step: float, count: int) -> List[SimArrival]:
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
    base=st.sampled_from([1024, 4096, 8192]),
)
def test_bound_holds_under_sustained_overload(strategy: str, short_len: int, rate_per_step: float, base: int) -> None:
    # The starvation pattern: budget = chunk = 256, one 2048-token prompt with nothing ahead of
    # it, then a stream of short prompts at one or more per step for longer than the run.
    arrivals = long_then_stream(256, 2048, short_len, rate_per_step, count=900)
    checker = run_checked(strategy, arrivals, 256, 256, OvertakeBoundSpec(base, 0.15), max_steps=300)
    assert 0 in checker.done_clock, "the long prompt must get its first token within the run"
    # Nothing was ahead of it: it loses at most W0 + one step, plus its own 8 chunks.
    assert checker.done_clock[0] <= 2048 + base + 256 + 255 * 8


def backlog_burst(count: int, long_len: int, short_len: int) -> List[SimArrival]:
    """A backlog of long prompts at once, then a burst of short ones."""
    arrivals = [SimArrival(i, 0.0, long_len, 1, "long") for i in range(count)]
    arrivals += [SimArrival(count + i, 1e-3, short_len, 1, "short") for i in range(count * 4)]
    return arrivals


@pytest.mark.parametrize("strategy", ["promote_shortest", "hrrn"])
def test_a_backlog_does_not_age_requests_into_fcfs(strategy: str) -> None:
    # The defect of a bound on plain waiting: behind a backlog every request ages and the aged set
    # is served first come, first served.  Overtaking allowances grow with the backlog, so the
    # short prompts still go ahead of most of the long ones.
    arrivals = backlog_burst(8, 2048, 64)
    spec = OvertakeBoundSpec()
    checker = run_checked(strategy, arrivals, 256, 256, spec, max_steps=400)
    shorts_done = [checker.done_clock[rid] for rid in range(8, 40)]
    last_long_done = max(checker.done_clock[rid] for rid in range(8))
    assert max(shorts_done) < last_long_done / 2


@pytest.mark.parametrize("strategy, short_len", [("promote_shortest", 256), ("promote_shortest", 200), ("hrrn", 256)])
def test_without_the_bound_the_seed_strategies_starve_the_long_prompt(strategy: str, short_len: int) -> None:
    # Shows the property tests can fail: with the bound disabled the same stream keeps the long
    # prompt waiting far past what a bound of 8192 tokens allows.
    arrivals = long_then_stream(256, 2048, short_len, 1.0, count=900)
    checker = run_checked(strategy, arrivals, 256, 256, OvertakeBoundSpec.off(), max_steps=300)
    assert 0 not in checker.done_clock or checker.done_clock[0] > 2048 + 8192 + 256 + 255 * 8
    assert checker.overtaken[0] > OvertakeBoundSpec(8192, 0.15).allowance(0) + 256


@st.composite
def prioritised_streams(draw):
    """Arrivals per step with PD-style priorities: some requests are continuation segments."""
    budget = draw(st.sampled_from([64, 256]))
    chunk = draw(st.sampled_from([budget, budget // 2]))
    spec = OvertakeBoundSpec(draw(st.sampled_from([0, budget, 8 * budget])), draw(st.sampled_from([0.0, 0.15, 0.5])))
    steps = []
    for _ in range(draw(st.integers(1, 30))):
        arrivals = []
        for _ in range(draw(st.integers(0, 3))):
            long_prompt = draw(st.booleans())
            prompt = draw(st.integers(2 * budget, 10 * budget)) if long_prompt else draw(st.integers(2, budget))
            arrivals.append((prompt, draw(st.sampled_from([0, 0, 0, -1]))))
        steps.append(arrivals)
    return budget, chunk, spec, steps


@pytest.mark.parametrize("strategy", STRATEGIES)
@settings(max_examples=30, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(stream=prioritised_streams())
def test_the_bound_holds_with_continuation_segments(strategy: str, stream) -> None:
    # A PD prefill node: nothing decodes, continuation segments (infer_high_priority -1) arrive
    # among normal requests.  Work default puts ahead of r includes continuations that arrive
    # after it, so H(r) is r's elders plus every higher-priority request that arrives while it waits.
    budget, chunk, spec, steps = stream
    bound_strategy = build_prefill_queue_strategy(strategy, spec)
    planner = StepPlanner(budget, chunk)
    counter = ProcessedPrefillTokenCounter()
    waiting: List[InferReq] = []
    seq: Dict[int, int] = {}
    ahead_chunks: Dict[int, int] = {}
    ahead: Dict[int, int] = {}
    overtaken: Dict[int, int] = {}
    next_id = 0
    for step_index in range(len(steps) + 400):
        for prompt, prio in steps[step_index] if step_index < len(steps) else []:
            req = InferReq(request_id=next_id, prompt_ids=[1] * prompt, infer_high_priority=prio,
                           arrival_processed_prefill_tokens=counter.value)
            seq[next_id] = next_id
            key = (prio, next_id)
            before = [q for q in waiting if (q.infer_high_priority, seq[q.request_id]) < key]
            ahead[next_id] = sum(q.pending_token_num for q in before)
            ahead_chunks[next_id] = sum(math.ceil(q.pending_token_num / chunk) for q in before)
            overtaken[next_id] = 0
            for q in waiting:  # a later higher-priority arrival joins the work ahead of q
                if (prio, next_id) < (q.infer_high_priority, seq[q.request_id]):
                    ahead_chunks[q.request_id] += math.ceil(prompt / chunk)
            waiting.append(req)
            next_id += 1
        if not waiting:
            if step_index >= len(steps):
                break
            continue
        classified = NO_DECODE_CLASSIFIER.split(waiting)
        ordered = bound_strategy.order(classified.prefill, counter.value)
        plan = planner.plan(classified.decode, ordered, 1 << 30)
        served = [((c.req.infer_high_priority, seq[c.req.request_id]), c.token_num) for c in plan.prefill_chunks]
        for req in plan.skipped:
            mine = (req.infer_high_priority, seq[req.request_id])
            overtaken[req.request_id] += sum(t for k, t in served if k > mine)
        bound_strategy.charge([(c.req, c.token_num) for c in plan.prefill_chunks], plan.skipped)
        submit_prefill(plan, counter)
        for c in plan.prefill_chunks:
            c.req.cur_kv_len = c.end
        waiting = [r for r in waiting if r.pending_token_num > 0]
    assert not waiting, "every request finishes"
    for rid, value in overtaken.items():
        limit = spec.allowance(ahead[rid]) + budget + (chunk - 1) * ahead_chunks[rid]
        if strategy == "default":
            limit = (chunk - 1) * ahead_chunks[rid]
        assert value <= limit, f"request {rid} was overtaken by {value} > bound {limit}"
