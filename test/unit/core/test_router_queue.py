"""Router admission: the KV projection, the request cap, lanes, and the queue's own bookkeeping."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from router_queue_test_support import router_req as _req

from lightllm.server.router.req_queue.normal_queue import NormalReqQueue, RunningRequests


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


# --- incremental bookkeeping: the running total and O(1) aborts ---------------------------------


@settings(max_examples=150, deadline=None)
@given(
    ops=st.lists(
        st.tuples(
            st.sampled_from(["new", "new", "admit", "release", "abort", "abort_missing", "direct", "del"]),
            st.booleans(),
            st.integers(1, 300),
            st.integers(0, 10**6),
        ),
        min_size=1,
        max_size=100,
    )
)
def test_running_total_and_waiting_lanes_match_a_plain_model(ops):
    """After any sequence of arrivals, admissions, releases, aborts (of waiting, running or unknown
    requests) and direct writes to the running set, the kept total equals the sum over the running
    set and the waiting requests are exactly a plain per-lane FIFO model's."""
    queue = NormalReqQueue(capacity_tokens=2000, running_max_req_size=6)
    model_waiting = []  # every waiting request, in arrival order
    next_id = 0
    for op, high, size, pick in ops:
        if op == "new":
            req = _req(next_id, size, size // 3 + 1, high=high)
            next_id += 1
            queue.append(req)
            model_waiting.append(req)
        elif op == "admit":
            admitted = queue.admit()
            for req in admitted:
                model_waiting.remove(req)
        elif op == "release" and queue.running:
            queue.release(list(queue.running)[pick % len(queue.running)])
        elif op == "abort" and model_waiting:
            req = model_waiting[pick % len(model_waiting)]
            assert queue.remove_waiting(req.request_id) is req
            model_waiting.remove(req)
            assert queue.remove_waiting(req.request_id) is None  # a second abort finds nothing
        elif op == "abort_missing":
            assert queue.remove_waiting(10**9 + pick) is None
        elif op == "direct":
            # What the router does for a decode node's prefilled arrival (and a replaced entry).
            key = 10**7 + pick % 5
            queue.running[key] = _req(key, size, 1)
        elif op == "del" and queue.running:
            key = list(queue.running)[pick % len(queue.running)]
            if pick % 2:
                del queue.running[key]
            else:
                queue.running.pop(key)
        assert queue.projected_running_tokens() == sum(r.projected_token_num for r in queue.running.values())
        expected = [r for r in model_waiting if r.high_priority_request] + [
            r for r in model_waiting if not r.high_priority_request
        ]
        assert queue.waiting_requests() == expected
        assert len(queue) == len(expected)
        # A lane's head is never an aborted request (admission looks only at heads).
        assert all(lane[0] in expected for lane in (queue._high, queue._normal) if lane)


def test_running_set_keeps_its_total_through_every_dict_operation():
    running = RunningRequests([(1, _req(1, 10, 5))])
    assert running.projected_tokens == 15
    running[1] = _req(1, 20, 5)  # replaced, not added
    running.setdefault(2, _req(2, 1, 1))
    running.setdefault(2, _req(2, 100, 100))  # present: unchanged
    running.update({3: _req(3, 3, 3)}, **{})
    running |= {4: _req(4, 4, 4)}
    assert running.projected_tokens == 25 + 2 + 6 + 8
    assert running.pop(99, None) is None
    with pytest.raises(KeyError):
        running.pop(99)
    with pytest.raises(KeyError):
        del running[99]
    running.popitem()
    assert running.projected_tokens == 25 + 2 + 6
    running.clear()
    assert running.projected_tokens == 0 and not running


def test_an_aborted_request_deep_in_the_lane_is_skipped_at_admission():
    queue = NormalReqQueue(capacity_tokens=10**6, running_max_req_size=100)
    for rid in range(6):
        queue.append(_req(rid))
    queue.remove_waiting(3)
    queue.remove_waiting(0)  # the head: dropped at once
    assert [r.request_id for r in queue.waiting_requests()] == [1, 2, 4, 5]
    assert [r.request_id for r in queue.admit()] == [1, 2, 4, 5]
    assert len(queue) == 0 and not queue._normal
