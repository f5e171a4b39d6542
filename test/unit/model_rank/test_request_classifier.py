"""Tests of the decode/prefill classification predicate and the processed-token counter."""

from __future__ import annotations

from typing import List

import pytest

from lightllm.server.model_rank.scheduling.infer_req import InferReq
from lightllm.server.model_rank.scheduling.processed_token_counter import ProcessedPrefillTokenCounter
from lightllm.server.model_rank.scheduling.request_classifier import (
    NO_DECODE_CLASSIFIER,
    NORMAL_CLASSIFIER,
    STRICT_PREFILL_CLASSIFIER,
    prefill_need_token_num,
)


def make_req(request_id: int, prompt_len: int, *, output_len: int = 0, cur_kv_len: int = 0) -> InferReq:
    """A request with ``prompt_len`` prompt tokens, ``output_len`` outputs and given KV length."""
    return InferReq(
        request_id=request_id,
        prompt_ids=list(range(prompt_len)),
        output_ids=[7] * output_len,
        cur_kv_len=cur_kv_len,
    )


def test_single_pending_token_after_output_is_decode_in_every_variant_but_no_decode() -> None:
    req = make_req(1, 10, output_len=1, cur_kv_len=10)
    assert req.pending_token_num == 1
    assert NORMAL_CLASSIFIER.is_decode(req)
    assert STRICT_PREFILL_CLASSIFIER.is_decode(req)
    assert not NO_DECODE_CLASSIFIER.is_decode(req)


def test_fresh_prompt_is_prefill() -> None:
    req = make_req(1, 10)
    assert not NORMAL_CLASSIFIER.is_decode(req)
    assert not STRICT_PREFILL_CLASSIFIER.is_decode(req)


def test_prefix_hit_leaving_one_prompt_token_differs_between_variants() -> None:
    req = make_req(1, 10, cur_kv_len=9)
    assert req.pending_token_num == 1
    assert NORMAL_CLASSIFIER.is_decode(req)
    assert not STRICT_PREFILL_CLASSIFIER.is_decode(req)


def test_split_keeps_input_order_in_both_groups() -> None:
    reqs = [
        make_req(5, 8),
        make_req(3, 4, output_len=2, cur_kv_len=5),
        make_req(9, 6, cur_kv_len=2),
        make_req(1, 3, output_len=1, cur_kv_len=3),
    ]
    decode, prefill = NORMAL_CLASSIFIER.split(reqs)
    assert [r.request_id for r in decode] == [3, 1]
    assert [r.request_id for r in prefill] == [5, 9]
    decode, prefill = NO_DECODE_CLASSIFIER.split(reqs)
    assert decode == []
    assert [r.request_id for r in prefill] == [5, 3, 9, 1]


@pytest.mark.parametrize(
    ("pending", "chunk", "expected"),
    [(100, None, 100), (100, 0, 100), (100, 32, 32), (20, 32, 20)],
)
def test_prefill_need_token_num(pending: int, chunk, expected: int) -> None:
    assert prefill_need_token_num(make_req(1, pending), chunk) == expected


def test_prefill_need_token_num_rejects_negative_chunk() -> None:
    with pytest.raises(ValueError, match="chunked_prefill_size"):
        prefill_need_token_num(make_req(1, 4), -1)


def test_counter_advances_and_snapshots() -> None:
    counter = ProcessedPrefillTokenCounter()
    assert counter.value == 0
    counter.advance(0)
    counter.advance(128)
    assert counter.value == 128
    arrivals: List[int] = [counter.snapshot()]
    counter.advance(5)
    arrivals.append(counter.snapshot())
    assert arrivals == [128, 133]
    assert ProcessedPrefillTokenCounter(initial=7).value == 7


@pytest.mark.parametrize("bad", [-1, 1.5, True, "3"])
def test_counter_rejects_bad_advance(bad) -> None:
    counter = ProcessedPrefillTokenCounter()
    with pytest.raises(ValueError, match="n must be"):
        counter.advance(bad)
    assert counter.value == 0


def test_counter_rejects_negative_initial() -> None:
    with pytest.raises(ValueError, match="initial"):
        ProcessedPrefillTokenCounter(initial=-3)
