"""A decode node's KV hold: the first request refused for KV gets it before smaller ones take it.

Plain scheduling objects (the simulator's cost executor and token-count KV view); the hold's
clock is the agreed time the backend is given (rank 0's on a server), here set by each test.
"""

from __future__ import annotations

from typing import List

import pytest

from lightllm.benchmark.simulator.cost_executor import CostModelExecutor
from lightllm.benchmark.simulator.cost_model import load_profile
from lightllm.common.sampling import SamplingParams
from lightllm.server.core.objs.request_spec import RequestSpec
from lightllm.server.model_rank.scheduling.decode_backend import (
    LIMIT_KV_TOKENS,
    LIMIT_REQUEST_SLOTS,
    DecodeBackend,
    KvReservationRefused,
)
from lightllm.server.model_rank.scheduling.decode_kv_hold import HOLD_SECONDS, HOLD_STEPS, RELEASE_GRACE_SECONDS, KvHoldLine
from lightllm.server.model_rank.scheduling.infer_req import InferReq
from lightllm.server.model_rank.scheduling.kv_view import TokenCountKvView
from lightllm.server.model_rank.scheduling.prefill_queue_strategy import build_prefill_queue_strategy
from lightllm.server.model_rank.scheduling.step_planner import StepPlanner


def _backend(capacity: int, rows: int = 64) -> DecodeBackend:
    return DecodeBackend(CostModelExecutor(load_profile("h100_qwen_0p8b")), TokenCountKvView(capacity, rows),
                         build_prefill_queue_strategy("hrrn"), StepPlanner(256, 64), [], 4096)


def _spec(prompt: int, new: int) -> RequestSpec:
    return RequestSpec([7] * prompt, SamplingParams(max_new_tokens=new, ignore_eos=True))


def _reserve(backend: DecodeBackend, request_id: int, prompt: int, new: int) -> InferReq:
    return backend.reserve_prefilled(request_id, _spec(prompt, new))


def _refused(backend: DecodeBackend, request_id: int, prompt: int, new: int) -> str:
    with pytest.raises(KvReservationRefused) as refused:
        _reserve(backend, request_id, prompt, new)
    assert refused.value.limit == LIMIT_KV_TOKENS
    assert request_id not in backend.requests
    return str(refused.value)


def _held(backend: DecodeBackend):
    return backend.held_request()


def _steps(backend: DecodeBackend, count: int) -> None:
    for _ in range(count):
        backend.step()


def _run_to_end(backend: DecodeBackend, *reqs: InferReq) -> None:
    for req in reqs:
        backend.admit_prefilled(req, 7)
    for _ in range(1000):
        if not any(r.request_id in backend.requests for r in reqs):
            return
        backend.step()
    raise AssertionError("the requests did not finish")


def test_the_held_request_gets_its_kv_before_smaller_ones_take_it() -> None:
    backend = _backend(100)
    first = _reserve(backend, 1, 40, 20)  # 60 of 100
    assert _refused(backend, 2, 60, 20) == ("no KV to reserve: request 2 needs 80 KV tokens (prompt 60 + 20 to "
                                           "generate), 40 allocatable and not promised; held: no other request "
                                           "takes the KV it waits for")
    # Without the hold this one would fit (20 <= 40) and keep the large one waiting.
    assert _refused(backend, 3, 10, 10) == ("no KV to reserve: request 3 needs 20 KV tokens (prompt 10 + 10 to "
                                           "generate), 40 allocatable and not promised, 40 of them held for "
                                           "request 2, refused earlier")
    _run_to_end(backend, first)
    _reserve(backend, 3, 10, 10)  # 100 free: 20 beyond the held 80
    _refused(backend, 4, 10, 10)  # 80 free, all of them held
    _reserve(backend, 2, 60, 20)  # the held request's retry
    assert _held(backend) is not None and _held(backend).request_id == 4  # refused next: held next
    assert sorted(backend.requests) == [2, 3]


def test_smaller_requests_use_the_kv_beyond_the_held_need() -> None:
    backend = _backend(300)
    big = _reserve(backend, 1, 200, 50)
    _refused(backend, 2, 100, 20)  # needs 120, 50 free: held
    _run_to_end(backend, big)
    granted: List[int] = []
    for request_id in range(10, 20):
        try:
            _reserve(backend, request_id, 20, 10)
            granted.append(request_id)
        except KvReservationRefused as refused:
            assert "120 of them held for request 2, refused earlier" in str(refused)
    assert granted == list(range(10, 16))  # 6 x 30 = 180 = 300 - 120
    _reserve(backend, 2, 100, 20)
    assert _held(backend) is not None and _held(backend).request_id == 16  # the first short refused
    assert backend.promised_token_num() == 6 * 10 + 20


def test_a_hold_expires_once_its_request_stops_asking() -> None:
    backend = _backend(100)
    _reserve(backend, 1, 40, 20)  # waits for its transfer: nothing frees
    backend.observe_time(10.0)
    _refused(backend, 2, 60, 20)
    backend.observe_time(10.0 + HOLD_SECONDS / 2)
    _refused(backend, 2, 60, 20)  # it asks again: the hold lives HOLD_SECONDS from now
    _steps(backend, HOLD_STEPS + 1)
    backend.observe_time(10.0 + HOLD_SECONDS / 2 + HOLD_SECONDS)
    assert "held for request 2" in _refused(backend, 3, 10, 10)
    backend.observe_time(10.0 + HOLD_SECONDS / 2 + HOLD_SECONDS + 0.01)  # longer than HOLD_SECONDS without an ask
    _reserve(backend, 3, 10, 10)
    assert _held(backend) is None
    backend.observe_time(0.0)  # a stale stamp does not move the clock back
    assert backend.hold_line.now == 10.0 + HOLD_SECONDS / 2 + HOLD_SECONDS + 0.01

def test_a_refused_request_becomes_held_only_when_no_other_is() -> None:
    backend = _backend(100)
    _reserve(backend, 1, 40, 20)
    _refused(backend, 2, 60, 20)
    assert "held for request 2" in _refused(backend, 3, 50, 20)
    assert _held(backend) is not None and (_held(backend).request_id, _held(backend).tokens) == (2, 80)


def test_a_node_running_nothing_keeps_its_kv_for_the_held_request() -> None:
    # A need close to the whole cache fits only on an empty node; a short request asking first
    # (every 50 ms where the held one asks once a second) would take the emptied node each time.
    backend = _backend(100, rows=2)
    first = _reserve(backend, 1, 40, 20)
    _refused(backend, 2, 60, 35)  # needs 95: held
    backend.transfer_failed(first)
    backend.step()
    assert not backend.requests
    assert "95 of them held for request 2" in _refused(backend, 3, 10, 10)  # 20 > 100 - 95
    _reserve(backend, 4, 2, 3)  # 5 <= 100 - 95: the KV beyond the held need is still used
    assert "the last one kept for request 2" in _slot_refused(backend, 5, 1, 1)
    _run_to_end(backend, backend.requests[4])
    _reserve(backend, 2, 60, 35)


def test_a_stale_hold_on_an_idle_node_ends_after_hold_seconds() -> None:
    # Its request gave up (or went to another decode node): large requests wait at most HOLD_SECONDS,
    # by time alone (the node ran one step since).
    backend = _backend(100)
    first = _reserve(backend, 1, 40, 20)
    backend.observe_time(5.0)
    _refused(backend, 2, 60, 30)
    backend.transfer_failed(first)
    backend.step()
    backend.observe_time(5.0 + HOLD_SECONDS)
    assert "held for request 2" in _refused(backend, 3, 50, 20)
    backend.observe_time(5.0 + HOLD_SECONDS + 0.5)
    _reserve(backend, 3, 50, 20)

def test_a_request_larger_than_the_kv_cache_is_not_held() -> None:
    backend = _backend(100)
    _reserve(backend, 1, 40, 20)
    assert _refused(backend, 2, 100, 50) == ("no KV to reserve: request 2 needs 150 KV tokens (prompt 100 + 50 to "
                                            "generate), 40 allocatable and not promised; more than the whole KV "
                                            "cache (100 tokens), so it is not held")
    assert _held(backend) is None
    _reserve(backend, 3, 10, 10)


def _slot_refused(backend: DecodeBackend, request_id: int, prompt: int, new: int) -> str:
    with pytest.raises(KvReservationRefused) as refused:
        _reserve(backend, request_id, prompt, new)
    assert refused.value.limit == LIMIT_REQUEST_SLOTS
    return str(refused.value)


def test_a_request_refused_for_a_slot_is_held_and_gets_the_next_slot() -> None:
    # Rows, not KV, bind here: a freed row went to whichever small request asked first.
    backend = _backend(1000, rows=2)
    first = _reserve(backend, 1, 10, 10)
    _reserve(backend, 2, 10, 10)
    _slot_refused(backend, 3, 200, 50)  # the large one, refused for a row: held
    assert _held(backend) is not None and (_held(backend).request_id, _held(backend).tokens) == (3, 250)
    _run_to_end(backend, first)  # a row frees
    assert _slot_refused(backend, 4, 10, 10) == ("no request slot to reserve: 1 of 2 request slots "
                                                 "(--running_max_req_size) are in use, the last one kept for "
                                                 "request 3, refused earlier")
    _reserve(backend, 3, 200, 50)
    assert _held(backend) is not None and _held(backend).request_id == 4  # refused next: held next


def test_the_held_request_refused_for_a_slot_still_counts_as_asking() -> None:
    backend = _backend(200, rows=2)
    _reserve(backend, 1, 100, 40)
    _reserve(backend, 5, 10, 10)  # both rows in use
    backend.observe_time(1.0)
    _slot_refused(backend, 2, 60, 20)
    backend.observe_time(2.5)
    _slot_refused(backend, 2, 60, 20)
    assert _held(backend).asked_at == 2.5

def test_a_later_segment_needing_more_than_the_cache_is_forgotten() -> None:
    backend = _backend(100)
    _reserve(backend, 1, 40, 20)
    _refused(backend, 2, 60, 20)  # held at 80
    assert "so it is not held" in _refused(backend, 2, 90, 20)  # the same id now needs 110 > 100
    assert _held(backend) is None
    _reserve(backend, 3, 10, 10)


def test_expired_entries_are_dropped_when_the_clock_moves() -> None:
    backend = _backend(100)
    _reserve(backend, 1, 40, 20)
    for request_id in range(2, 50):
        _refused(backend, request_id, 60, 20)
    assert len(backend.hold_line) == 48
    _steps(backend, HOLD_STEPS + 1)
    backend.observe_time(HOLD_SECONDS + 0.01)
    assert _held(backend) is None and len(backend.hold_line) == 0

def test_the_next_held_request_is_the_earliest_refused_that_still_asks() -> None:
    backend = _backend(100)
    _reserve(backend, 1, 40, 20)  # waits for its transfer: nothing frees
    _refused(backend, 2, 60, 20)  # held
    assert "held for request 2" in _refused(backend, 3, 50, 10)  # refused second: waits behind 2
    assert "held for request 2" in _refused(backend, 4, 50, 20)  # refused third
    _steps(backend, HOLD_STEPS + 1)
    backend.observe_time(HOLD_SECONDS / 2)
    assert "held for request 2" in _refused(backend, 4, 50, 20)  # 2 and 3 stop asking, 4 does not
    backend.observe_time(HOLD_SECONDS + 0.01)
    assert "held: no other" in _refused(backend, 4, 50, 20)  # 2 and 3 expired: 4 is held
    assert _held(backend) is not None and (_held(backend).request_id, _held(backend).tokens) == (4, 70)


def test_a_granted_request_keeps_its_place_until_its_kv_arrives() -> None:
    # Its prefill node may answer busy after the decode node granted it: the master gives the
    # reservation back and asks again, and the request must not go to the back of the line.
    backend = _backend(100)
    first = _reserve(backend, 1, 40, 20)
    _refused(backend, 2, 60, 20)  # held
    assert "held for request 2" in _refused(backend, 3, 50, 20)
    _run_to_end(backend, first)
    granted = _reserve(backend, 2, 60, 20)
    assert _held(backend).request_id == 3  # while 2 is reserved here, the next in line is held
    backend.observe_time(HOLD_SECONDS + 5.0)  # a prompt queued long on its prefill node
    assert "held: no other" in _refused(backend, 3, 50, 20)  # 3 is held (40 of 100 are 2's), 2 not forgotten
    backend.transfer_failed(granted)  # the reservation given back before any KV arrived
    backend.step()
    backend.observe_time(HOLD_SECONDS + 5.5)
    assert "held for request 2" in _refused(backend, 3, 50, 20)  # 2 is first again
    granted = _reserve(backend, 2, 60, 20)
    backend.admit_prefilled(granted, 7)  # its KV arrived: it leaves the line
    assert 2 not in backend.hold_line and _held(backend).request_id == 3


def test_a_reservation_ended_without_its_kv_keeps_the_place_only_briefly() -> None:
    # The prefill node's first token ended the request, or its client left: the decode node
    # cannot tell that from a busy prefill node, so it waits for a re-ask only a short grace.
    backend = _backend(100)
    first = _reserve(backend, 1, 40, 20)
    backend.observe_time(10.0)
    _refused(backend, 2, 60, 35)  # needs 95
    _run_to_end(backend, first)
    granted = _reserve(backend, 2, 60, 35)
    backend.abort(2)
    backend.transfer_failed(granted)
    backend.step()
    backend.observe_time(10.0 + RELEASE_GRACE_SECONDS - 0.01)
    assert "95 of them held for request 2" in _refused(backend, 3, 10, 10)
    backend.observe_time(10.0 + RELEASE_GRACE_SECONDS + 0.01)
    _reserve(backend, 3, 10, 10)
    assert 2 not in backend.hold_line


def test_a_held_request_keeps_its_place_while_slow_steps_delay_its_asks() -> None:
    # Measured on 1P1D at load average 10: CPU steps of a second or more put a held request's
    # asks 3.2 s apart, and with time alone it lost its place and waited 20 s more.
    backend = _backend(100)
    _reserve(backend, 1, 40, 20)  # a node running a request
    backend.observe_time(1.0)
    _refused(backend, 2, 60, 20)  # held
    _steps(backend, HOLD_STEPS - 1)  # slow steps: fewer than HOLD_STEPS in the next 3.2 s
    backend.observe_time(4.2)
    assert "held for request 2" in _refused(backend, 3, 50, 20)
    _steps(backend, 2)  # HOLD_STEPS + 1 since request 2 asked, and over HOLD_SECONDS: expired
    assert "held: no other" in _refused(backend, 3, 50, 20)


def test_the_hold_line_refuses_a_nonpositive_hold() -> None:
    with pytest.raises(ValueError, match="hold_seconds must be > 0, got 0"):
        KvHoldLine(0)
    with pytest.raises(ValueError, match="hold_steps must be >= 0, got -1"):
        KvHoldLine(hold_steps=-1)
