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


def test_a_new_segment_has_every_slot_free(shm):
    owner, other = shm
    assert [other.holder(slot) for slot in range(3)] == [NO_REQUEST] * 3


def test_internal_fields_round_trip_to_router_and_rank_views(shm):
    owner, other = shm
    owner.write_request(1, 10**15 + 3, [5, 6, 7], _params(logprobs=2), True, infer_high_priority=-4, segment_index=2)
    fields = other.admission_fields(1, 10**15 + 3)
    assert (fields.prompt_len, fields.max_new_tokens, fields.high_priority_request) == (3, 4, True)
    assert (fields.infer_high_priority, fields.segment_index) == (-4, 2)
    request = other.read_request(1, 10**15 + 3)
    assert request.prompt_ids == [5, 6, 7] and request.params.logprobs == 2
    assert (request.high_priority_request, request.infer_high_priority, request.segment_index) == (True, -4, 2)
    owner.write_request(0, 11, [5], _params())
    plain = other.read_request(0, 11)
    assert (plain.high_priority_request, plain.infer_high_priority, plain.segment_index) == (False, 0, 0)
    assert (plain.pd_kind, plain.kv_start, other.admission_fields(0, 11).pd_kind) == (PD_KIND_NONE, 0, PD_KIND_NONE)
    # A PD prefill request sends from kv_start; a decode node's arrival is marked for the router.
    owner.write_request(2, 12, [5, 6, 7], _params(), pd_kind=PD_KIND_PREFILL, kv_start=2)
    assert (other.read_request(2, 12).pd_kind, other.read_request(2, 12).kv_start) == (PD_KIND_PREFILL, 2)
    owner.release(1, 10**15 + 3)
    owner.write_request(1, 13, [5, 6], _params(), pd_kind=PD_KIND_DECODE)
    assert other.admission_fields(1, 13).pd_kind == PD_KIND_DECODE


def test_output_is_published_and_read_back_through_typed_methods(shm):
    owner, other = shm
    owner.write_request(0, 7, [5, 6], _params(logprobs=1, prompt_logprobs=1, stop_sequences=["END"]))
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
    owner.write_request(2, 1, [5, 6], _params())
    assert owner.release(2, 1)
    with pytest.raises(StaleRecordError, match="slot 2 no longer holds request 1 \\(it is free\\)"):
        other.read_output(2, 1, 0)
    owner.write_request(2, 2, [8, 9, 10], _params())
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
    owner.write_request(0, 5, [5], _params())
    with pytest.raises(SlotOccupiedError, match="slot 0 still holds request 5"):
        owner.write_request(0, 6, [5], _params())
    assert owner.read_request(0, 5).prompt_ids == [5]


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"request_id": -1}, "request_id must be an int"),
        ({"request_id": True}, "request_id must be an int"),
        ({"request_id": 2**63}, "request_id must be an int"),
        ({"infer_high_priority": 2**31}, "infer_high_priority must be a 32-bit int"),
        ({"infer_high_priority": 1.5}, "infer_high_priority must be a 32-bit int"),
        ({"segment_index": -1}, "segment_index must be an int"),
        ({"prompt_ids": list(range(30))}, "exceeds max_req_total_len"),
        ({"pd_kind": 3}, "pd_kind must be one of"),
        ({"pd_kind": PD_KIND_PREFILL, "kv_start": 2}, r"kv_start must be an int in \[0, 1\]"),
        ({"pd_kind": PD_KIND_DECODE, "kv_start": 1}, "kv_start applies to PD prefill requests only"),
    ],
)
def test_refused_writes_leave_the_slot_free(shm, kwargs, message):
    owner, _ = shm
    call = {"slot": 0, "request_id": 3, "prompt_ids": [5, 6], "params": _params(), **kwargs}
    internal = {name: call.pop(name) for name in ("infer_high_priority", "segment_index", "pd_kind", "kv_start")
                if name in call}
    with pytest.raises(ValueError, match=message):
        owner.write_request(**call, **internal)
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
