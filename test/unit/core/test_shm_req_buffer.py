"""The shared-memory request contract: typed access, request-id checks on every read and write.

Real segments (``multiprocessing.shared_memory``); two mappings of the same segment stand for
two processes.  Top logprobs live in a second segment whose rows only requests that ask for
them hold.
"""

from __future__ import annotations

import re
import uuid
from multiprocessing import shared_memory
from pathlib import Path

import pytest

from lightllm.common.sampling import MAX_TOP_LOGPROBS, SamplingParams
from lightllm.server.core.objs.finish_status import FINISH_LENGTH, FINISH_NONE
from lightllm.server.core.objs.request_spec import RequestSpec
from lightllm.server.core.objs.shm_req_buffer import ShmReqBuffer
from lightllm.server.core.objs.shm_req_layout import (
    NO_REQUEST,
    NO_TOP_SLOT,
    PD_KIND_DECODE,
    PD_KIND_NONE,
    PD_KIND_PREFILL,
    record_dtype,
    top_rows_dtype,
    wants_top_rows,
)
from lightllm.server.core.objs.shm_req_views import SlotOccupiedError, StaleRecordError

REPO = Path(__file__).resolve().parents[3]


@pytest.fixture()
def shm():
    name = f"lightllm_test_{uuid.uuid4().hex[:12]}"
    owner = ShmReqBuffer(name, 3, 32, create=True, top_slot_num=2)
    other = ShmReqBuffer(name, 3, 32, create=False, top_slot_num=2)  # another process's mapping
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
                                             infer_high_priority=-4, segment_index=2), top_slot=1)
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
    owner.write_request(0, 7, _spec([5, 6], _params(logprobs=1, prompt_logprobs=1, stop_sequences=["END"])), 1)
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


def test_tokens_published_together_read_back_as_one_by_one(shm, caplog):
    owner, other = shm
    for slot, request_id, prompt in ((0, 11, [5, 6]), (1, 12, [7]), (2, 13, [8, 9, 10])):
        owner.write_request(slot, request_id, _spec(prompt))
    assert other.publish_token(1, 12, 30, -0.75) == 1  # request 12 already has a token
    assert other.publish_tokens([2, 0, 1], [13, 11, 12], [40, 41, 42], [-0.5, -1.25, -2.0]) == [1, 1, 2]
    assert other.publish_tokens([0], [11], [43], [-3.0]) == [2]
    reads = {request_id: owner.read_output(slot, request_id, 0) for slot, request_id in ((0, 11), (1, 12), (2, 13))}
    assert (reads[11].token_ids, reads[11].logprobs) == ([41, 43], [-1.25, -3.0])
    assert (reads[12].token_ids, reads[12].logprobs) == ([30, 42], [-0.75, -2.0])
    assert (reads[13].output_len, reads[13].token_ids) == (1, [40])
    # A slot that no longer holds its request is skipped (length 0, a warning); the rest are written.
    assert owner.release(2, 13)
    owner.write_request(2, 14, _spec([1, 2]))
    with caplog.at_level("WARNING"):
        assert other.publish_tokens([2, 1], [13, 12], [50, 51], [-0.1, -0.2]) == [0, 3]
    assert "stale write of a token to slot 2 for request 13" in caplog.text
    assert other.read_output(2, 14, 0).output_len == 0
    assert owner.read_output(1, 12, 0).token_ids == [30, 42, 51]
    assert other.publish_tokens([], [], [], []) == []
    with pytest.raises(ValueError, match="more than once"):
        other.publish_tokens([1, 1], [12, 12], [1, 2], [0.0, 0.0])
    with pytest.raises(ValueError, match="do not match"):
        other.publish_tokens([1], [12, 13], [1], [0.0])


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


def _top_row_owners(buffer: ShmReqBuffer) -> list:
    return buffer._tops.array["request_id"].tolist()


def _segment_exists(name: str) -> bool:
    try:
        segment = shared_memory.SharedMemory(name=name)
    except FileNotFoundError:
        return False
    segment.close()
    return True


def test_top_alternatives_are_not_in_the_record():
    """A record pays 20 bytes per position; the 160 bytes of alternatives are a top row's."""
    per_position = record_dtype(2000).itemsize - record_dtype(1000).itemsize
    assert per_position == 20 * 1000
    assert top_rows_dtype(2000).itemsize - top_rows_dtype(1000).itemsize == 2 * 4 * MAX_TOP_LOGPROBS * 1000
    assert not {"token_top_ids", "token_top_logprobs"} & set(record_dtype(8).names)
    assert ShmReqBuffer.segment_bytes(3, 32, 2) == (3 * record_dtype(32).itemsize, 2 * top_rows_dtype(32).itemsize)


@pytest.mark.parametrize(
    ("fields", "wants"),
    [({}, False), ({"logprobs": 0}, False), ({"prompt_logprobs": 0}, False), ({"logprobs": 0, "prompt_logprobs": 0}, False),
     ({"logprobs": 1}, True), ({"prompt_logprobs": 3}, True), ({"logprobs": 0, "prompt_logprobs": 1}, True)],
)
def test_only_requests_asking_for_alternatives_take_a_top_row(fields, wants):
    assert wants_top_rows(_params(**fields)) is wants


def test_a_request_without_alternatives_never_touches_the_top_rows(shm):
    owner, other = shm
    # Chosen-token logprobs of output and prompt live in the record itself.
    owner.write_request(0, 4, _spec([5, 6], _params(logprobs=0, prompt_logprobs=0)))
    assert int(owner.array[0]["top_slot"]) == NO_TOP_SLOT
    assert other.publish_prompt_logprobs(0, 4, [(1, -0.75, [], 2)])
    assert other.publish_token(0, 4, 40, -0.5)
    snapshot = owner.read_output(0, 4, 0)
    assert (snapshot.token_ids, snapshot.logprobs, snapshot.top_logprobs) == ([40], [-0.5], None)
    assert owner.prompt_logprobs(0, 4) == [(6, -0.75, [], 2)]
    # Neither top row was claimed: both are free for requests that ask.
    assert _top_row_owners(owner) == [NO_REQUEST, NO_REQUEST]
    owner.write_request(1, 5, _spec([5], _params(logprobs=1)), 0)
    owner.write_request(2, 6, _spec([5], _params(prompt_logprobs=1)), 1)
    assert _top_row_owners(owner) == [5, 6]
    assert (int(owner.array[1]["top_slot"]), int(owner.array[2]["top_slot"])) == (0, 1)


@pytest.mark.parametrize(
    ("params", "top_slot", "message"),
    [
        (_params(logprobs=2), None, "asks for top logprobs .* but got no top_slot"),
        (_params(), 0, "top_slot was given for a request that asks for no top logprobs"),
        (_params(logprobs=2), 2, r"top_slot must be an int in \[0, 2\)"),
        (_params(logprobs=2), -1, r"top_slot must be an int in \[0, 2\)"),
    ],
)
def test_a_top_row_is_given_exactly_when_the_request_asks(shm, params, top_slot, message):
    owner, _ = shm
    with pytest.raises(ValueError, match=message):
        owner.write_request(0, 3, _spec([5, 6], params), top_slot)
    assert owner.holder(0) == NO_REQUEST


def test_a_top_row_in_use_cannot_be_claimed_by_a_second_request(shm):
    owner, _ = shm
    owner.write_request(0, 5, _spec([5], _params(logprobs=1)), 1)
    with pytest.raises(SlotOccupiedError, match="top-logprob slot 1 still holds request 5"):
        owner.write_request(1, 6, _spec([5], _params(logprobs=1)), 1)
    assert owner.holder(1) == NO_REQUEST  # the refused request claimed nothing


def test_release_frees_the_top_row_and_its_stale_owner_is_refused(shm):
    owner, other = shm
    owner.write_request(0, 1, _spec([5, 6], _params(logprobs=2)), 0)
    assert other.publish_token(0, 1, 40, -0.5, [(40, -0.5), (41, -1.5)])
    assert owner.release(0, 1) and _top_row_owners(owner) == [NO_REQUEST, NO_REQUEST]
    # The row goes to another request in another record slot; the old writer cannot reach it.
    owner.write_request(2, 2, _spec([7, 8], _params(logprobs=1)), 0)
    assert other.publish_token(2, 2, 50, -0.25, [(50, -0.25)])
    assert not other.publish_token(0, 1, 99, -0.1, [(99, -0.1)])
    assert owner.read_output(2, 2, 0).top_logprobs == [[(50, -0.25)]]  # unused entries hold id -1


def test_a_record_whose_top_row_was_taken_from_it_fails_its_reader(shm, caplog):
    """Defence in depth: a top row names its owner, checked apart from the record's."""
    owner, other = shm
    owner.write_request(0, 1, _spec([5], _params(logprobs=1)), 0)
    owner._tops.array[0]["request_id"] = 77  # a protocol bug handed the row to request 77
    with pytest.raises(StaleRecordError, match="top-logprob slot 0 no longer holds request 1 \\(it holds request 77\\)"):
        other.read_output(0, 1, 0)
    with caplog.at_level("WARNING", logger="lightllm.shm_req_buffer"):
        assert other.publish_token(0, 1, 40, -0.5, [(40, -0.5)]) == 1  # the token, without the row
    assert "top-logprob slot 0 for request 1" in caplog.text
    assert owner.release(0, 1)
    assert int(owner._tops.array[0]["request_id"]) == 77  # release frees only its own row


def test_close_and_unlink_cover_both_segments():
    name = f"lightllm_test_{uuid.uuid4().hex[:12]}"
    buffer = ShmReqBuffer(name, 2, 16, create=True, top_slot_num=1)
    assert _segment_exists(name) and _segment_exists(f"{name}_top")
    buffer.close()
    buffer.unlink()
    assert not _segment_exists(name) and not _segment_exists(f"{name}_top")
    plain = ShmReqBuffer(name, 2, 16, create=True)  # no top rows: no second segment
    try:
        assert not _segment_exists(f"{name}_top")
        with pytest.raises(ValueError, match="no top_slot"):
            plain.write_request(0, 1, _spec([5], _params(logprobs=1)))
    finally:
        plain.close()
        plain.unlink()
