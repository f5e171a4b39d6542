"""The overtaking bound and the wait formula with mixed batches (the server's default).

With mixed batches every decoding request rides in the prefill forward: it takes one token of
the step's budget (``StepPlanner.plan``) and the processed-prefill-token counter counts it.  So
the head of the order gets ``min(C, B - decode rows)`` tokens, at least ``C' = min(C, B - (N - 1))``,
and a request's wait on the counter includes the decode rows of the steps that skipped it.  The
formulas of ``docs/EN/prefill_queue_strategy.md`` ("The bound as a formula"):

    overtaken(r) <= W0 + floor(e * A(r)) + B + (C - 1) * sum(ceil(P_q / C') for q in H(r))
    wait(r)      <= A(r) + L + overtaken(r) + (B - 1) * ceil(L / C') + decode(r)
    decode(r)    <= (N - 1) * skipped(r),  skipped(r) <= sum(ceil(P_q / C') for q in H(r)) + overtaken(r)

Everything is recomputed here from each step's plan, driving the simulator (the server's router
queue, strategies, bound, planner and counter; only forwards are virtual).
"""

from __future__ import annotations

import math
from typing import Dict, List

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from bound_test_support import BOUND_TEST_PROFILE
from lightllm.benchmark.simulator.engine import Simulator
from lightllm.benchmark.simulator.sim_types import SimArrival, SimServerConfig
from lightllm.server.model_rank.scheduling.prefill_queue_strategy import available_strategy_names
from lightllm.server.model_rank.scheduling.prefill_queue_strategy.overtake_bound import OvertakeBoundSpec

STRATEGIES = available_strategy_names()

PROFILE = BOUND_TEST_PROFILE


class MixedWaitChecker:
    """Drives a simulator step by step and recomputes each request's terms of the formulas."""

    def __init__(self, sim: Simulator, budget: int, chunk: int, running_max: int, mixed: bool) -> None:
        self.sim, self.budget, self.chunk = sim, budget, chunk
        # The least chunk the head gets: decode rows (at most N - 1 besides it) share the budget.
        self.head_chunk = min(chunk, budget - (running_max - 1)) if mixed else chunk
        self.decode_cap = running_max - 1 if mixed else 0
        self.seq: Dict[int, int] = {}
        self.ahead: Dict[int, int] = {}
        self.ahead_chunks: Dict[int, int] = {}
        self.prompt: Dict[int, int] = {}
        self.overtaken: Dict[int, int] = {}
        self.decode: Dict[int, int] = {}
        self.skipped: Dict[int, int] = {}
        self.arrival_clock: Dict[int, int] = {}
        self.done_clock: Dict[int, int] = {}

    def step(self) -> None:
        sim = self.sim
        pending_before = [(r, r.pending_token_num) for r in sim.live_requests() if not r.output_ids]
        clock_before = sim.counter.value
        trace = sim.step()
        if trace.ordered is None:
            return
        newcomers = sorted((r for r in trace.ordered if r.request_id not in self.seq), key=lambda r: r.request_id)
        pending_before += [(r, r.input_len) for r in newcomers]  # no prefix cache in the simulator
        for req in newcomers:
            rid = req.request_id
            self.seq[rid] = len(self.seq)
            before = [p for q, p in pending_before if self.seq.get(q.request_id, 1 << 62) < self.seq[rid]]
            self.ahead[rid] = sum(before)
            self.ahead_chunks[rid] = sum(math.ceil(p / self.head_chunk) for p in before)
            self.prompt[rid] = req.input_len
            self.arrival_clock[rid] = clock_before
            self.overtaken[rid] = self.decode[rid] = self.skipped[rid] = 0
        plan = trace.plan
        if plan is None or not plan.prefill_chunks:
            return
        decode_rows = len(plan.decode_reqs) if plan.mixed else 0
        served = [(self.seq[c.req.request_id], c.token_num) for c in plan.prefill_chunks]
        for req in plan.skipped:
            rid = req.request_id
            self.overtaken[rid] += sum(t for s, t in served if s > self.seq[rid])
            self.decode[rid] += decode_rows
            self.skipped[rid] += 1
        for chunk in plan.prefill_chunks:
            if chunk.req.output_ids and chunk.req.request_id not in self.done_clock:
                self.done_clock[chunk.req.request_id] = sim.counter.value

    def wait(self, rid: int) -> int:
        return self.done_clock[rid] - self.arrival_clock[rid]

    def wait_limit(self, rid: int) -> int:
        """The wait formula's right-hand side, with ``decode(r)`` as counted."""
        beside = (self.budget - 1) * math.ceil(self.prompt[rid] / self.head_chunk)
        return self.ahead[rid] + self.prompt[rid] + self.overtaken[rid] + beside + self.decode[rid]

    def check(self, strategy: str, spec: OvertakeBoundSpec) -> None:
        for rid, overtaken in self.overtaken.items():
            fill = (self.chunk - 1) * self.ahead_chunks[rid]
            if strategy == "default":
                assert overtaken <= fill
            elif spec.enabled:
                assert overtaken <= spec.allowance(self.ahead[rid]) + self.budget + fill, rid
            assert self.decode[rid] <= self.decode_cap * self.skipped[rid]
            assert self.skipped[rid] <= self.ahead_chunks[rid] + overtaken, rid
            if rid in self.done_clock:
                assert self.wait(rid) <= self.wait_limit(rid), rid


def run(strategy: str, arrivals: List[SimArrival], budget: int, chunk: int, running_max: int,
        spec: OvertakeBoundSpec, mixed: bool = True, max_steps: int = 3000) -> MixedWaitChecker:
    config = SimServerConfig(batch_max_tokens=budget, chunked_prefill_size=chunk, running_max_req_size=running_max,
                             overtake_bound=spec, mixed_batches=mixed)
    sim = Simulator(PROFILE, strategy, config)
    for arrival in arrivals:
        sim.add_arrival(arrival)
    checker = MixedWaitChecker(sim, budget, chunk, running_max, mixed)
    steps = 0
    while sim.has_work() and steps < max_steps:
        checker.step()
        steps += 1
    checker.check(strategy, spec)
    return checker


@st.composite
def decode_heavy_streams(draw):
    """Requests that decode for a long time next to bursts of long and short prompts."""
    budget = draw(st.sampled_from([64, 128]))
    chunk = draw(st.sampled_from([budget, budget // 2]))
    # Up to 40 requests: with budget 64 the decode rows can leave the head less than a chunk.
    running_max = draw(st.sampled_from([3, 16, 40]))
    spec = OvertakeBoundSpec(draw(st.sampled_from([0, budget, 8 * budget])), draw(st.sampled_from([0.0, 0.15, 1.0])))
    arrivals = []
    clock = 0.0
    for request_id in range(draw(st.integers(min_value=1, max_value=50))):
        clock += draw(st.sampled_from([0.0, 0.0, 0.0005, 0.002]))
        kind = draw(st.sampled_from(["decoder", "long", "short"]))
        prompt = {"decoder": draw(st.integers(1, 8)), "long": draw(st.integers(4 * budget, 12 * budget)),
                  "short": draw(st.integers(1, budget))}[kind]
        output = draw(st.integers(50, 300)) if kind == "decoder" else draw(st.integers(1, 4))
        arrivals.append(SimArrival(request_id, clock, prompt, output, "long" if kind == "long" else "short"))
    return budget, chunk, running_max, spec, arrivals


@pytest.mark.parametrize("strategy", STRATEGIES)
@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(stream=decode_heavy_streams())
def test_bound_and_wait_formula_hold_with_mixed_batches(strategy: str, stream) -> None:
    budget, chunk, running_max, spec, arrivals = stream
    run(strategy, arrivals, budget, chunk, running_max, spec)


def test_decode_rows_count_on_the_wait_clock_and_keep_a_second_chunk_out():
    """The case the docs quote: 200 requests decoding, then a 100,000-token prompt q and a
    1024-token prompt r, at the server's defaults (B 2048, C 1024, N 256), under default.

    Mixed: each step gives q 1024 tokens and carries 200 decode rows; r's 1024-token chunk does
    not fit in the 824 left, so r waits for q (97 steps).  The formula without the decode rows
    (the one the docs gave before, valid with --disable_mixed_batches) is exceeded; with them it
    holds.  Without mixed batches r's chunk rides beside q's in the first step."""
    arrivals = [SimArrival(i, 0.0, 8, 2000, "short") for i in range(200)]  # decode past the test
    arrivals += [SimArrival(1000, 0.01, 100_000, 1, "long"), SimArrival(1001, 0.01, 1024, 1, "short")]
    mixed = run("default", arrivals, 2048, 1024, 256, OvertakeBoundSpec(), mixed=True, max_steps=400)
    assert mixed.ahead[1001] == 100_000 and mixed.overtaken[1001] == 0
    assert mixed.skipped[1001] == 97 and mixed.decode[1001] == 200 * 97
    assert mixed.wait(1001) == 97 * (1024 + 200) + (672 + 1024 + 200) == 120_624
    without_decode_rows = mixed.wait_limit(1001) - mixed.decode[1001]
    assert without_decode_rows == 100_000 + 1024 + 0 + 2047 < mixed.wait(1001) <= mixed.wait_limit(1001) == 122_471
    separate = run("default", arrivals, 2048, 1024, 256, OvertakeBoundSpec(), mixed=False, max_steps=400)
    assert separate.wait(1001) == 2048 and separate.decode[1001] == 0
