"""Router admission."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from lightllm.server.router.req_queue.normal_queue import NormalReqQueue, RouterReq


def _req(rid, input_len=10, new=10, high=False):
    return RouterReq(rid, rid, input_len, new, high)


def test_admits_within_kv_projection_and_request_cap():
    queue = NormalReqQueue(capacity_tokens=100, running_max_req_size=3)
    for rid in range(5):
        queue.append(_req(rid, 20, 10))  # 30 tokens each
    assert [r.request_id for r in queue.admit()] == [0, 1, 2]
    queue.release(0)
    assert [r.request_id for r in queue.admit()] == [3]
    assert queue.admit() == []  # 3 running, cap reached
    assert len(queue) == 1


def test_high_priority_first_and_fifo_among_themselves():
    queue = NormalReqQueue(capacity_tokens=1000, running_max_req_size=2)
    queue.append(_req(1))
    queue.append(_req(2, high=True))
    queue.append(_req(3, high=True))
    assert [r.request_id for r in queue.admit()] == [2, 3]


def test_blocked_head_does_not_let_smaller_requests_overtake():
    queue = NormalReqQueue(capacity_tokens=100, running_max_req_size=10)
    queue.append(_req(1, 50, 10))
    queue.append(_req(2, 50, 10))
    queue.append(_req(3, 5, 5))
    assert [r.request_id for r in queue.admit()] == [1]
    assert queue.admit() == []  # request 2 does not fit; 3 waits behind it


def test_remove_waiting_and_lone_oversized_request():
    queue = NormalReqQueue(capacity_tokens=50, running_max_req_size=10)
    queue.append(_req(1, 80, 10))
    queue.append(_req(2))
    assert queue.remove_waiting(2).request_id == 2
    assert queue.remove_waiting(2) is None
    # With nothing running, a request larger than the projection still starts (it fits the
    # KV cache itself: the launcher guarantees max_req_total_len <= KV capacity).
    assert [r.request_id for r in queue.admit()] == [1]


# --- the waiting bound on the router side (--prefill_max_wait_tokens) ----------------------------


def _drive_high_priority_stream(max_wait_tokens: int, rounds: int = 200):
    """A large normal request, then a high-priority 100-token request every round.

    Each round the oldest running request finishes and admission runs once, so the batch never
    drains by itself.  Returns the round in which the large request was admitted (or None).
    """
    queue = NormalReqQueue(capacity_tokens=1000, running_max_req_size=4, max_wait_tokens=max_wait_tokens)
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


def test_without_aging_a_high_priority_stream_starves_a_normal_request():
    admitted_round, _ = _drive_high_priority_stream(max_wait_tokens=0)
    assert admitted_round is None


def test_aged_normal_head_goes_first_and_blocks_both_lanes_until_it_fits():
    admitted_round, queue = _drive_high_priority_stream(max_wait_tokens=1000)
    assert admitted_round is not None
    # Aged after more than 1000 admitted prompt tokens (11 high-priority requests of 100), then
    # admitted once the 4 requests running at that point have drained enough for 800 tokens.
    assert admitted_round <= 11 + 4
    # While it waited aged, no high-priority request overtook it.
    assert queue.admitted_prompt_tokens <= 4 * 100 + (1000 + 100) + 700


def _admission_order(max_wait_tokens):
    queue = NormalReqQueue(capacity_tokens=10_000, running_max_req_size=1, max_wait_tokens=max_wait_tokens)
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


def test_aged_heads_of_both_lanes_go_in_arrival_order():
    assert _admission_order(0) == [3, 4, 5, 1, 2]
    # After 20 admitted tokens requests 1 and 5 are both aged (> 15): 1 arrived first, and 2
    # (aged too) arrived before 5.
    assert _admission_order(15) == [3, 4, 1, 2, 5]


@pytest.mark.parametrize("bad", [-1, 1.5, True])
def test_bad_router_wait_bound_is_rejected(bad):
    with pytest.raises(ValueError, match="max_wait_tokens"):
        NormalReqQueue(capacity_tokens=10, running_max_req_size=1, max_wait_tokens=bad)


@settings(max_examples=150, deadline=None)
@given(
    ops=st.lists(
        st.tuples(st.sampled_from(["new", "new", "release", "admit"]), st.booleans(), st.integers(1, 400)),
        min_size=1,
        max_size=80,
    ),
    max_wait_tokens=st.sampled_from([0, 50, 300, 1000]),
)
def test_admission_rule_holds_on_random_traffic(ops, max_wait_tokens):
    """FIFO per lane, aged heads first in arrival order, a blocked head is never overtaken,
    and once arrivals stop and running requests finish, everyone is admitted."""
    queue = NormalReqQueue(capacity_tokens=1000, running_max_req_size=5, max_wait_tokens=max_wait_tokens)
    next_id = 0
    for op, high, size in ops:
        if op == "new":
            queue.append(_req(next_id, size, size // 4 + 1, high=high))
            next_id += 1
        elif op == "release" and queue.running:
            queue.release(next(iter(queue.running)))
        else:
            heads = [lane[0] for lane in (queue._high, queue._normal) if lane]
            aged_heads = [h for h in heads if queue.is_aged(h)]
            waiting_before = {r.request_id for lane in (queue._high, queue._normal) for r in lane}
            admitted = queue.admit()
            ids = [r.request_id for r in admitted]
            high_ids = [r.request_id for r in admitted if r.high_priority_request]
            normal_ids = [r.request_id for r in admitted if not r.high_priority_request]
            assert high_ids == sorted(high_ids) and normal_ids == sorted(normal_ids)  # FIFO per lane
            assert set(ids) <= waiting_before
            if aged_heads and ids:
                # The earliest aged head goes before anything else.
                assert ids[0] == min(h.request_id for h in aged_heads)
            if waiting_before and not ids:
                # Nothing admitted: the first head is blocked (batch full or it does not fit).
                assert queue.running
    # Liveness: no more arrivals; finish running requests one by one; everyone gets in.
    for _ in range(10 * (next_id + 1)):
        queue.admit()
        if not len(queue):
            break
        queue.release(next(iter(queue.running)))
    assert len(queue) == 0
