"""The shared-memory request contract: typed access, request-id checks on every read and write.

Real segments (``multiprocessing.shared_memory``); two mappings of the same segment stand for
two processes.
"""

from __future__ import annotations

import re
import uuid
from pathlib import Path

import pytest

from lightllm.common.sampling import SamplingParams
from lightllm.server.core.objs.finish_status import FINISH_LENGTH, FINISH_NONE
from lightllm.server.core.objs.request_spec import RequestSpec
from lightllm.server.core.objs.shm_req_buffer import ShmReqBuffer
from lightllm.server.core.objs.shm_req_layout import (
    NO_REQUEST,
    PD_KIND_DECODE,
    PD_KIND_NONE,
    PD_KIND_PREFILL,
    record_dtype,
)
from lightllm.server.core.objs.shm_req_views import SlotOccupiedError, StaleRecordError

REPO = Path(__file__).resolve().parents[2]


@pytest.fixture()
def shm():
    name = f"lightllm_test_{uuid.uuid4().hex[:12]}"
    owner = ShmReqBuffer(name, 3, 32, create=True)
    other = ShmReqBuffer(name, 3, 32, create=False)  # another process's mapping
    yield owner, other
    other.close()
    owner.close()
    owner.unlink()


def _params(**fields) -> SamplingParams:
    return SamplingParams(**{"max_new_tokens": 4, "temperature": 0.0, **fields})


def _spec(prompt_ids, params=None, **internal) -> RequestSpec:
    return RequestSpec.build(prompt_ids, params or _params(), **internal)


def test_a_new_segment_has_every_slot_free(shm):
    owner, other = shm
    assert [other.holder(slot) for slot in range(3)] == [NO_REQUEST] * 3


def test_internal_fields_round_trip_to_router_and_rank_views(shm):
    owner, other = shm
    owner.write_request(1, 10**15 + 3, _spec([5, 6, 7], _params(logprobs=2), high_priority_request=True,
                                             infer_high_priority=-4, segment_index=2))
    fields = other.admission_fields(1, 10**15 + 3)
    assert (fields.prompt_len, fields.max_new_tokens, fields.high_priority_request) == (3, 4, True)
    request = other.read_request(1, 10**15 + 3)
    assert request.prompt_ids == (5, 6, 7) and request.params.logprobs == 2
    assert (request.priority.high_priority_request, request.priority.infer_high_priority,
            request.segment.segment_index) == (True, -4, 2)
    owner.write_request(0, 11, _spec([5]))
    plain = other.read_request(0, 11)
    assert (plain.priority.high_priority_request, plain.priority.infer_high_priority,
            plain.segment.segment_index) == (False, 0, 0)
    assert (plain.pd.kind, plain.pd.kv_start, other.admission_fields(0, 11).pd_kind) == (PD_KIND_NONE, 0, PD_KIND_NONE)
    # A PD prefill request sends from kv_start; a decode node's arrival is marked for the router.
    owner.write_request(2, 12, _spec([5, 6, 7], pd_kind=PD_KIND_PREFILL, kv_start=2))
    assert other.read_request(2, 12).pd == RequestSpec.build([5, 6, 7], _params(), pd_kind=PD_KIND_PREFILL,
                                                             kv_start=2).pd
    owner.release(1, 10**15 + 3)
    owner.write_request(1, 13, _spec([5, 6], pd_kind=PD_KIND_DECODE))
    assert other.admission_fields(1, 13).pd_kind == PD_KIND_DECODE


def test_output_is_published_and_read_back_through_typed_methods(shm):
    owner, other = shm
    owner.write_request(0, 7, _spec([5, 6], _params(logprobs=1, prompt_logprobs=1, stop_sequences=["END"])))
    assert other.set_prompt_cache_len(0, 7, 1)
    assert other.publish_prompt_logprobs(0, 7, [(1, -0.25, [(6, -0.25)], 1)])
    assert other.publish_token(0, 7, 40, -0.5, [(40, -0.5)])
    snapshot = owner.read_output(0, 7, 0)
    assert (snapshot.token_ids, snapshot.logprobs, snapshot.finish_status) == ([40], [-0.5], FINISH_NONE)
    assert snapshot.top_logprobs == [[(40, -0.5)]] and snapshot.prompt_cache_len == 1
    assert other.publish_token(0, 7, 41, -1.0, [(41, -1.0)])
    assert other.set_finish_status(0, 7, FINISH_LENGTH)
    tail = owner.read_output(0, 7, 1)
    assert (tail.output_len, tail.token_ids, tail.finish_status) == (2, [41], FINISH_LENGTH)
    assert owner.prompt_logprobs(0, 7) == [(6, -0.25, [(6, -0.25)], 1)]
    options = owner.decode_options(0, 7)
    assert (options.prompt_ids, options.stop_sequences) == ([5, 6], ["END"])


def test_a_released_then_reused_slot_refuses_its_stale_owner(shm):
    owner, other = shm
    owner.write_request(2, 1, _spec([5, 6]))
    assert owner.release(2, 1)
    with pytest.raises(StaleRecordError, match="slot 2 no longer holds request 1 \\(it is free\\)"):
        other.read_output(2, 1, 0)
    owner.write_request(2, 2, _spec([8, 9, 10]))
    # Every reader of the old request fails clearly instead of reading request 2.
    for read in (other.admission_fields, other.read_request, other.decode_options, other.prompt_logprobs):
        with pytest.raises(StaleRecordError, match="it holds request 2"):
            read(2, 1)
    # Every writer of the old request is a no-op: request 2's record is untouched.
    assert not other.publish_token(2, 1, 99, -0.1)
    assert not other.set_finish_status(2, 1, FINISH_LENGTH)
    assert not other.set_prompt_cache_len(2, 1, 3)
    assert not other.publish_prompt_logprobs(2, 1, [(1, -0.1, [])])
    assert not owner.release(2, 1)  # a duplicate release cannot free request 2's slot
    snapshot = other.read_output(2, 2, 0)
    assert (snapshot.output_len, snapshot.finish_status, snapshot.prompt_cache_len) == (0, FINISH_NONE, 0)
    assert other.holder(2) == 2


def test_a_slot_in_use_cannot_be_claimed_again(shm):
    owner, _ = shm
    owner.write_request(0, 5, _spec([5]))
    with pytest.raises(SlotOccupiedError, match="slot 0 still holds request 5"):
        owner.write_request(0, 6, _spec([5]))
    assert owner.read_request(0, 5).prompt_ids == (5,)


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        # What the record itself needs; the request's own fields are RequestSpec's (test_request_spec.py).
        ({"request_id": -1}, "request_id must be an int"),
        ({"request_id": True}, "request_id must be an int"),
        ({"request_id": 2**63}, "request_id must be an int"),
        ({"spec": RequestSpec.build(list(range(30)), SamplingParams(max_new_tokens=4))}, "exceeds max_req_total_len"),
        ({"spec": ([5, 6], SamplingParams())}, "takes a RequestSpec"),
    ],
)
def test_refused_writes_leave_the_slot_free(shm, kwargs, message):
    owner, _ = shm
    call = {"slot": 0, "request_id": 3, "spec": _spec([5, 6]), **kwargs}
    with pytest.raises(ValueError, match=message):
        owner.write_request(**call)
    assert owner.holder(0) == NO_REQUEST


def test_fields_nobody_read_are_gone():
    names = record_dtype(8).names
    for dropped in ("state", "abort_flag", "cur_kv_len", "stop_string_hit"):
        assert dropped not in names
    assert "infer_high_priority" in names and "segment_index" in names


def test_no_module_but_the_buffer_touches_records():
    """The server's processes reach records only through ShmReqBuffer's methods."""
    pattern = re.compile(r"\bshm\w*\.(records|array)\b|\brecord_dtype\(")
    allowed = {"shm_req_buffer.py", "shm_req_layout.py"}
    offenders = [
        str(path.relative_to(REPO))
        for path in (REPO / "lightllm").rglob("*.py")
        if path.name not in allowed and pattern.search(path.read_text())
    ]
    assert offenders == []
