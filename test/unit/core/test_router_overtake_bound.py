"""The overtaking bound on the router side: how long the high-priority lane may overtake a normal request."""

from __future__ import annotations

import pytest
from hypothesis import example, given, settings
from hypothesis import strategies as st
from router_queue_test_support import router_req as _req

from lightllm.server.model_rank.scheduling.prefill_queue_strategy.overtake_bound import OvertakeBoundSpec
from lightllm.server.router.req_queue.normal_queue import NormalReqQueue


def _drive_high_priority_stream(bound: OvertakeBoundSpec, rounds: int = 200):
    """A large normal request, then a high-priority 100-token request every round.

    Each round the oldest running request finishes and admission runs once, so the batch never
    drains by itself.  Returns the round in which the large request was admitted (or None).
    """
    queue = NormalReqQueue(capacity_tokens=1000, running_max_req_size=4, overtake_bound=bound)
    for rid in range(4):
        queue.append(_req(100 + rid, 100, 100, high=True))
    queue.admit()
    queue.append(_req(1, 700, 100))  # does not fit while the stream keeps the batch busy
    for round_index in range(rounds):
        queue.append(_req(1000 + round_index, 100, 100, high=True))
        if queue.running:
            queue.release(next(iter(queue.running)))
        if 1 in [r.request_id for r in queue.admit()]:
            return round_index, queue
    return None, queue


def test_without_the_bound_a_high_priority_stream_starves_a_normal_request():
    admitted_round, _ = _drive_high_priority_stream(OvertakeBoundSpec.off())
    assert admitted_round is None


def test_protected_normal_head_goes_first_and_blocks_both_lanes_until_it_fits():
    admitted_round, queue = _drive_high_priority_stream(OvertakeBoundSpec(1000, 0.0))
    assert admitted_round is not None
    # Protected once 1000 prompt tokens of later high-priority requests were admitted (10 of 100),
    # then admitted once the 4 requests running at that point have drained enough for 800 tokens.
    assert admitted_round <= 10 + 4
    # While it waited protected, no high-priority request overtook it.
    assert queue.admitted_prompt_tokens <= 4 * 100 + 1000 + 100 + 700


def test_the_allowance_grows_with_the_fcfs_wait():
    # Nothing waits ahead of the first normal request; 300 tokens wait ahead of the second.
    queue = NormalReqQueue(capacity_tokens=10_000, running_max_req_size=1, overtake_bound=OvertakeBoundSpec(10, 0.5))
    queue.append(_req(1, 300, 1))
    queue.append(_req(2, 20, 1))
    assert queue._arrival[1][1] == 10 and queue._arrival[2][1] == 10 + 150


def _admission_order(bound: OvertakeBoundSpec):
    queue = NormalReqQueue(capacity_tokens=10_000, running_max_req_size=1, overtake_bound=bound)
    queue.append(_req(1, 10, 1))
    queue.append(_req(2, 10, 1))
    for rid in (3, 4, 5):
        queue.append(_req(rid, 10, 1, high=True))
    order = []
    while len(queue):
        for r in queue.admit():
            order.append(r.request_id)
            queue.release(r.request_id)
    return order


def test_protected_normal_heads_go_before_later_high_priority_requests():
    assert _admission_order(OvertakeBoundSpec.off()) == [3, 4, 5, 1, 2]
    # Allowance 15 (nothing ahead of 1; 2 has 10 tokens ahead, fraction 0): after two later
    # high-priority requests (20 tokens) both are protected and go before 5.
    assert _admission_order(OvertakeBoundSpec(15, 0.0)) == [3, 4, 1, 2, 5]
    # A high-priority head that arrived first is never overtaken by a protected normal one.
    queue = NormalReqQueue(capacity_tokens=10_000, running_max_req_size=1, overtake_bound=OvertakeBoundSpec(0, 0.0))
    queue.append(_req(7, 10, 1, high=True))
    queue.append(_req(8, 10, 1))
    assert [r.request_id for r in queue.admit()] == [7]


@pytest.mark.parametrize("bad", [-1, 1.5, True])
def test_bad_router_bound_is_rejected(bad):
    with pytest.raises(ValueError, match="overtake"):
        NormalReqQueue(capacity_tokens=10, running_max_req_size=1, overtake_bound=bad)


def _check_admission_rule(ops, bound: OvertakeBoundSpec, capacity: int = 1000) -> None:
    """Drive a queue with ``ops`` and check the rule against a plain recomputation.

    Ops: ``new`` (a request of the given lane and size), ``long`` (a normal prompt larger than the
    projection, admitted alone when nothing runs: requests arriving while it waits get a large
    allowance), ``burst`` (five high-priority requests), ``release``, ``drain`` (release every
    running request), ``abort`` (the oldest waiting request), ``admit``, and ``long_ahead``: the
    batch drains, a long prompt and a normal request behind it arrive, the long prompt is admitted,
    and a second normal request arrives with little ahead of it (so the lane's head has a larger
    allowance than the request behind it).
    Request ids are the arrival order over both lanes.
    """
    queue = NormalReqQueue(capacity_tokens=capacity, running_max_req_size=5, overtake_bound=bound)
    next_id = 0
    allowance = {}  # normal request id -> allowance, from the prompt tokens waiting when it arrived
    overtaken = {}  # waiting normal request id -> high-priority tokens admitted after it arrived
    sizes = {}
    largest_high = 0

    def arrive(high: bool, size: int) -> None:
        nonlocal next_id, largest_high
        waiting_ahead = sum(sizes[r.request_id] for r in queue.waiting_requests())
        sizes[next_id] = size
        queue.append(_req(next_id, size, size // 4 + 1, high=high))
        if high:
            largest_high = max(largest_high, size)
        else:
            allowance[next_id] = bound.allowance(waiting_ahead)
            overtaken[next_id] = 0
        next_id += 1

    def ops_admit(admitted, waiting=None) -> None:
        """Check one admission round against the rule, request by request."""
        if waiting is None:
            waiting = {r.request_id for r in queue.waiting_requests()} | {r.request_id for r in admitted}
        ids = [r.request_id for r in admitted]
        high_ids = [r.request_id for r in admitted if r.high_priority_request]
        normal_ids = [r.request_id for r in admitted if not r.high_priority_request]
        assert high_ids == sorted(high_ids) and normal_ids == sorted(normal_ids)  # FIFO per lane
        assert set(ids) <= waiting
        if waiting and not ids:
            # Nothing admitted: the first head is blocked (batch full or it does not fit).
            assert queue.running
        for req in admitted:
            rid = req.request_id
            if not req.high_priority_request:
                overtaken.pop(rid)
                continue
            # The rule: a high-priority request goes only while no normal request that
            # arrived before it is protected, wherever that request stands in its lane.
            protected = [n for n, tokens in overtaken.items() if n < rid and tokens >= allowance[n]]
            assert not (bound.enabled and protected), (rid, protected)
            for n in overtaken:
                if n < rid:
                    overtaken[n] += sizes[rid]
        for n, tokens in overtaken.items():
            assert queue.overtaken_tokens(queue._waiting[n]) == tokens
            if bound.enabled:
                # The documented consequence: at most the allowance plus one request's prompt.
                assert tokens <= allowance[n] + largest_high - 1 or tokens == 0

    for op, high, size in ops:
        waiting = {r.request_id for r in queue.waiting_requests()}
        if op == "new":
            arrive(high, size)
        elif op == "long":
            arrive(False, 5 * capacity)
        elif op == "burst":
            for _ in range(5):
                arrive(True, size)
        elif op == "release" and queue.running:
            queue.release(next(iter(queue.running)))
        elif op in ("drain", "long_ahead"):
            for rid in list(queue.running):
                queue.release(rid)
            if op == "long_ahead":
                arrive(False, 5 * capacity)
                arrive(False, size)
                ops_admit(queue.admit())  # the long prompt runs (if it is first) and blocks the rest
                arrive(False, size)
        elif op == "abort" and waiting:
            queue.remove_waiting(min(waiting))
            overtaken.pop(min(waiting), None)
        elif op == "admit":
            ops_admit(queue.admit(), waiting)

    # Liveness: no more arrivals; finish running requests one by one; everyone gets in.
    for _ in range(10 * (next_id + 1)):
        queue.admit()
        if not len(queue):
            break
        queue.release(next(iter(queue.running)))
    assert len(queue) == 0


# The pattern the rule must cover beyond the lane's head: a normal request arrives behind a long
# prompt (large allowance), a second one arrives once the long prompt runs (small allowance), and
# a high-priority stream follows.  Testing only the normal head let the stream overtake the second
# by the first one's allowance.
_LONG_PROMPT_AHEAD = (
    [("new", False, 300), ("admit", False, 1), ("long_ahead", False, 100)]
    + [("burst", True, 100), ("drain", False, 1), ("admit", False, 1)] * 12
)


@settings(max_examples=200, deadline=None)
@example(ops=_LONG_PROMPT_AHEAD, base=0, fraction=0.15)
@example(ops=_LONG_PROMPT_AHEAD, base=50, fraction=1.0)
@given(
    ops=st.lists(
        st.tuples(
            st.sampled_from(
                ["new", "new", "long", "long_ahead", "burst", "burst", "release", "drain", "admit", "admit", "abort"]
            ),
            st.booleans(),
            st.integers(1, 400),
        ),
        min_size=1,
        max_size=80,
    ),
    base=st.sampled_from([0, 50, 300, 1000]),
    fraction=st.sampled_from([0.0, 0.15, 1.0]),
)
def test_admission_rule_holds_on_random_traffic(ops, base, fraction):
    """FIFO per lane; a high-priority request is admitted only while no normal request that
    arrived before it is protected (recomputed here); overtaking stays within the allowance plus
    one request; a blocked head is never overtaken; once arrivals stop and running requests
    finish, everyone is admitted."""
    _check_admission_rule(ops, OvertakeBoundSpec(base, fraction))


@settings(max_examples=50, deadline=None)
@given(
    ops=st.lists(
        st.tuples(st.sampled_from(["new", "long", "long_ahead", "burst", "release", "drain", "admit", "abort"]),
                  st.booleans(),
                  st.integers(1, 400)),
        min_size=1,
        max_size=60,
    )
)
def test_admission_without_the_bound_is_plain_lane_priority(ops):
    """With the bound off the high-priority lane always goes first (FIFO, liveness still hold)."""
    _check_admission_rule(ops, OvertakeBoundSpec.off())


def test_a_normal_request_behind_an_older_one_with_a_larger_allowance_is_protected():
    """The outside review's case (defaults 2048 + 0.15): r0 waits behind a 100K-token prompt
    (allowance 17048), r behind r0 alone (allowance 2063); 100-token high-priority requests stream.
    r must be overtaken by at most its own allowance plus one prompt, not r0's."""
    queue = NormalReqQueue(capacity_tokens=10**7, running_max_req_size=2, overtake_bound=OvertakeBoundSpec())
    queue.append(_req(0, 100, 1))
    assert [r.request_id for r in queue.admit()] == [0]
    queue.append(_req(1, 100_000, 1))  # a long prompt
    queue.append(_req(2, 100, 1))  # r0
    assert [r.request_id for r in queue.admit()] == [1]
    queue.append(_req(3, 100, 1))  # r
    assert queue._arrival[2][1] == 2048 + 15_000 and queue._arrival[3][1] == 2048 + 15
    for rid in range(100, 500):
        queue.append(_req(rid, 100, 1, high=True))
    queue.release(0)
    queue.release(1)
    overtaking = 0
    while True:
        admitted = [r.request_id for r in queue.admit()]
        if 3 in admitted:
            overtaking += 100 * sum(1 for rid in admitted[: admitted.index(3)] if rid >= 100)
            break
        overtaking += 100 * sum(1 for rid in admitted if rid >= 100)
        for rid in admitted:
            queue.release(rid)
    # Protected after 21 requests (2100 >= 2063); r0 and r then go before the 22nd.
    assert overtaking == 2100 <= 2063 + 100
