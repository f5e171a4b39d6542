"""Router admission."""

from __future__ import annotations

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
