"""Rank 0 writes a step's tokens into the real shared-memory records: batched where it can, one by
one where order or alternatives need it, and the reader sees the same thing either way."""

from __future__ import annotations

import types
from typing import Any

import pytest

from lightllm.common.sampling import SamplingParams
from lightllm.server.core.objs.io_messages import StepOutput
from lightllm.server.core.objs.request_spec import RequestSpec
from lightllm.server.model_rank.scheduling.step_report import StepReport

from shm_test_support import scratch_req_buffer
from step_publisher_test_support import publisher_over


@pytest.fixture()
def shm():
    with scratch_req_buffer(4, 32, top_slot_num=1) as buffer:
        yield buffer


def _req(request_id: int, slot: int) -> Any:
    return types.SimpleNamespace(request_id=request_id, shm_index=slot, scheduled_ns=0)


def test_tokens_of_a_step_read_back_in_order_whichever_way_they_were_written(shm) -> None:
    plain_params = SamplingParams(temperature=0, max_new_tokens=8)
    shm.write_request(0, 10, RequestSpec([5, 6], plain_params))
    shm.write_request(1, 11, RequestSpec([7], plain_params))
    shm.write_request(2, 12, RequestSpec([8, 9], SamplingParams(temperature=0, max_new_tokens=8, logprobs=2)), 0)
    publisher = publisher_over(shm)
    a, b, c = _req(10, 0), _req(11, 1), _req(12, 2)
    # Batched: plain tokens of distinct requests; c asked for alternatives and goes one by one.
    publisher.publish(StepReport(tokens=[(a, 40, -0.5), (c, 41, -0.25), (b, 42, -1.0)],
                                 top_logprobs={12: [(41, -0.25), (3, -2.0)]}))
    sent = publisher.to_detokenization.messages
    assert sorted(sent[-1].updates) == [(10, 0, 1), (11, 1, 1), (12, 2, 1)]
    # One request twice in a step (a decode node's carried first token, then its next one): in order.
    publisher.publish(StepReport(tokens=[(b, 43, -0.1), (a, 44, -0.2), (b, 45, -0.3)], carried_tokens=1))
    assert sorted(sent[-1].updates) == [(10, 0, 2), (11, 1, 3)]
    assert isinstance(sent[-1], StepOutput)
    first, second, third = (shm.read_output(slot, rid, 0) for slot, rid in ((0, 10), (1, 11), (2, 12)))
    assert first.token_ids == [40, 44] and first.logprobs == pytest.approx([-0.5, -0.2])  # stored as float32
    assert second.token_ids == [42, 43, 45]
    assert second.logprobs == pytest.approx([-1.0, -0.1, -0.3])
    assert (third.token_ids, third.top_logprobs) == ([41], [[(41, -0.25), (3, -2.0)]])
