"""Rank 0's admission screen guarantees what SamplingBatch.build no longer checks per row.

``SamplingBatch.build`` trusts each row's params: that they are a ``SamplingParams`` and that
their stop token ids and logit_bias ids lie in the vocabulary, the width of the logits they
index.  These tests hold the screen to that, on the spec (``check_request``) and on a shared-
memory record damaged after the HTTP side wrote a valid one.
"""

from __future__ import annotations

import time
import uuid
from typing import Any, Callable, Iterator

import pytest

from lightllm.common.sampling import SamplingParams
from lightllm.server.core.objs.io_messages import AddRequests
from lightllm.server.core.objs.request_spec import RequestSpec, RequestSpecError
from lightllm.server.core.objs.shm_req_buffer import ShmReqBuffer
from lightllm.server.model_rank.scheduling.admission import RequestRejected, check_request

VOCAB = 100
MAX_LEN = 32


def _check(spec: Any) -> None:
    check_request(spec, vocab_size=VOCAB, max_req_total_len=MAX_LEN, grammar_enabled=False)


def _params(**fields: Any) -> SamplingParams:
    return SamplingParams(**{"max_new_tokens": 4, **fields})


def test_the_screen_admits_ids_inside_the_vocabulary() -> None:
    _check(RequestSpec([1], _params(min_new_tokens=1, stop_token_ids=[VOCAB - 1], logit_bias={VOCAB - 1: 1.0})))


@pytest.mark.parametrize(
    ("params", "message"),
    [
        (dict(min_new_tokens=1, stop_token_ids=[VOCAB]), "stop_token_ids must be < vocab_size"),
        (dict(logit_bias={VOCAB: 1.0}), r"logit_bias token id 100 is outside the vocabulary \[0, 100\)"),
    ],
)
def test_the_screen_refuses_ids_past_the_vocabulary(params: dict, message: str) -> None:
    with pytest.raises(RequestRejected, match=message):
        _check(RequestSpec([1], _params(**params)))


def test_every_admitted_row_holds_sampling_params() -> None:
    # The spec refuses other params, and the screen refuses anything but a spec.
    with pytest.raises(RequestSpecError, match="params must be SamplingParams"):
        RequestSpec([1], {"top_p": 1.0})  # type: ignore[arg-type]
    with pytest.raises(RequestRejected, match="must be a RequestSpec"):
        _check(([1], _params()))


class _RankLimits:
    """The part of a backend rank 0's screen calls: this rank's limits."""

    def check_request(self, spec: Any) -> None:
        _check(spec)


@pytest.fixture()
def shm() -> Iterator[ShmReqBuffer]:
    buffer = ShmReqBuffer(f"lightllm_test_{uuid.uuid4().hex[:12]}", 3, MAX_LEN, create=True)
    yield buffer
    buffer.close()
    buffer.unlink()


def _stop_id_past_the_vocabulary(rec: Any) -> None:
    rec["stop_token_num"] = 1
    rec["stop_token_ids"][0] = VOCAB


def _bias_id_past_the_vocabulary(rec: Any) -> None:
    rec["logit_bias_num"] = 1
    rec["logit_bias_ids"][0] = VOCAB + 7
    rec["logit_bias_values"][0] = 1.0


@pytest.mark.parametrize(
    ("damage", "why"),
    [(_stop_id_past_the_vocabulary, "stop_token_ids"), (_bias_id_past_the_vocabulary, "logit_bias token id 107")],
)
def test_rank0_screen_refuses_a_record_naming_ids_past_the_vocabulary(
    shm: ShmReqBuffer, caplog: pytest.LogCaptureFixture, damage: Callable[[Any], None], why: str
) -> None:
    # Imported here: the rank process module loads torch, which the checks above do not need.
    from lightllm.server.model_rank.rank_process import ModelRank, RejectRequests

    for slot in range(3):
        shm.write_request(slot, 100 + slot, RequestSpec([5, 6, 7], _params(min_new_tokens=1)))
    damage(shm.array[1])  # after the HTTP side built, checked and wrote a valid spec
    rank = ModelRank(_RankLimits(), shm, is_leader=True)  # rank 0's screen only: no process, no model
    with caplog.at_level("WARNING", logger="lightllm.model_rank"):
        before = time.monotonic()
        commands = rank.screen([AddRequests([(100, 0), (101, 1), (102, 2)])])
        after = time.monotonic()
    assert [type(c) for c in commands] == [AddRequests, RejectRequests]
    assert commands[0].requests == [(100, 0), (102, 2)] and commands[1] == RejectRequests([(101, 1)])
    # Rank 0's clock travels with the requests, so every TP rank's time-based decisions agree.
    assert before <= commands[0].leader_time <= after
    assert why in caplog.text, caplog.text
