"""Tests of the select-under-budget step planner and the prefill-token accounting."""

from __future__ import annotations

from typing import List, Sequence

import pytest

from lightllm.server.model_rank.scheduling.infer_req import InferReq
from lightllm.server.model_rank.scheduling import step_planner as step_planner_module
from lightllm.server.model_rank.scheduling.prefill_queue_strategy import build_prefill_queue_strategy
from lightllm.server.model_rank.scheduling.processed_token_counter import ProcessedPrefillTokenCounter
from lightllm.server.model_rank.scheduling.step_planner import (
    StepPlan,
    StepPlanner,
    submit_prefill,
)


def make_req(request_id: int, prompt_len: int, *, cur_kv_len: int = 0, arrival: int = 0) -> InferReq:
    return InferReq(
        request_id=request_id,
        prompt_ids=list(range(prompt_len)),
        cur_kv_len=cur_kv_len,
        arrival_processed_prefill_tokens=arrival,
    )


def decode_req(request_id: int) -> InferReq:
    return InferReq(request_id=request_id, prompt_ids=[0] * 6, output_ids=[1], cur_kv_len=6)


def ids(reqs: Sequence[InferReq]) -> List[int]:
    return [r.request_id for r in reqs]


def chunks(plan: StepPlan) -> List[tuple]:
    return [(c.req.request_id, c.start, c.token_num) for c in plan.prefill_chunks]


def test_empty_queue_gives_empty_plan() -> None:
    plan = StepPlanner(batch_max_tokens=64).plan([], [], 100)
    assert plan.decode_reqs == [] and plan.prefill_chunks == [] and plan.skipped == []
    assert plan.prefill_token_num == 0 and not plan.has_prefill


def test_budget_skips_a_request_and_later_smaller_ones_still_fit() -> None:
    reqs = [make_req(1, 60), make_req(2, 50), make_req(3, 30), make_req(4, 10)]
    plan = StepPlanner(batch_max_tokens=100).plan([], reqs, 10_000)
    assert chunks(plan) == [(1, 0, 60), (3, 0, 30), (4, 0, 10)]
    assert ids(plan.skipped) == [2]
    assert plan.prefill_token_num == 100 == sum(c.token_num for c in plan.prefill_chunks)


def test_chunked_prefill_caps_each_request_and_starts_at_cur_kv_len() -> None:
    reqs = [make_req(1, 300, cur_kv_len=128), make_req(2, 40), make_req(3, 200)]
    plan = StepPlanner(batch_max_tokens=256, chunked_prefill_size=128).plan([], reqs, 10_000)
    assert chunks(plan) == [(1, 128, 128), (2, 0, 40)]
    assert plan.prefill_chunks[0].end == 256
    assert ids(plan.skipped) == [3]
    assert plan.prefill_token_num == 168


@pytest.mark.parametrize("disabled", [None, 0])
def test_disabled_chunking_uses_whole_pending_length(disabled) -> None:
    plan = StepPlanner(batch_max_tokens=500, chunked_prefill_size=disabled).plan([], [make_req(1, 420)], 1000)
    assert chunks(plan) == [(1, 0, 420)]


def test_kv_limit_skips_later_prefill_and_reserves_decode_tokens_first() -> None:
    prefill = [make_req(1, 10), make_req(2, 50), make_req(3, 20), make_req(4, 18)]
    plan = StepPlanner(batch_max_tokens=1000).plan([decode_req(7), decode_req(8)], prefill, 32)
    assert ids(plan.decode_reqs) == [7, 8]
    assert plan.kv_starved_decode == []
    assert chunks(plan) == [(1, 0, 10), (3, 0, 20)]
    assert ids(plan.skipped) == [2, 4]
    assert plan.kv_token_num == 32


def test_unchunked_head_that_does_not_fit_kv_holds_the_room_for_itself() -> None:
    # Without chunking the head cannot be truncated; letting smaller prompts take the KV it
    # waits for could starve it, so no prefill runs until it fits.
    prefill = [make_req(1, 50), make_req(2, 20), make_req(3, 18)]
    plan = StepPlanner(batch_max_tokens=1000).plan([decode_req(7), decode_req(8)], prefill, 22)
    assert ids(plan.decode_reqs) == [7, 8]
    assert chunks(plan) == []
    assert ids(plan.skipped) == [1, 2, 3]
    assert plan.prefill_token_num == 0


def test_chunked_head_is_truncated_to_the_kv_and_budget_left() -> None:
    decode, prefill = [decode_req(7)], [make_req(1, 500), make_req(2, 8)]
    planner = StepPlanner(batch_max_tokens=256, chunked_prefill_size=128)
    by_kv = planner.plan(decode, prefill, 41)
    assert chunks(by_kv) == [(1, 0, 40)]
    assert ids(by_kv.skipped) == [2]
    mixed = StepPlanner(batch_max_tokens=100, chunked_prefill_size=100, mixed=True).plan(decode, prefill, 1000)
    assert chunks(mixed) == [(1, 0, 99)]
    assert mixed.prefill_token_num == 100


def test_decodes_short_of_kv_are_reported_starved_in_order() -> None:
    decode = [decode_req(7), decode_req(8), decode_req(9)]
    plan = StepPlanner(batch_max_tokens=100).plan(decode, [make_req(1, 5)], lambda: 2)
    assert ids(plan.decode_reqs) == [7, 8]
    assert ids(plan.kv_starved_decode) == [9]
    assert ids(plan.skipped) == [1]
    assert not plan.has_prefill


def test_kv_callable_is_called_once() -> None:
    calls: List[int] = []

    def free() -> int:
        calls.append(1)
        return 100

    StepPlanner(batch_max_tokens=64).plan([decode_req(3)], [make_req(1, 10), make_req(2, 10)], free)
    assert len(calls) == 1


def test_mixed_counts_decode_tokens_and_shrinks_prefill_budget() -> None:
    decode, prefill = [decode_req(7), decode_req(8)], [make_req(1, 99), make_req(2, 98)]
    planner, mixed_planner = StepPlanner(batch_max_tokens=100), StepPlanner(batch_max_tokens=100, mixed=True)
    separate = planner.plan(decode, prefill, 1000)
    assert chunks(separate) == [(1, 0, 99)]
    assert separate.prefill_token_num == 99
    mixed = mixed_planner.plan(decode, prefill, 1000)
    assert ids(mixed.decode_reqs) == [7, 8]
    # The unchunked head no longer fits next to the decodes, and nothing overtakes it.
    assert chunks(mixed) == []
    assert ids(mixed.skipped) == [1, 2]
    assert mixed.prefill_token_num == 2
    fits = mixed_planner.plan([decode_req(7)], [make_req(2, 98), make_req(1, 99)], 1000)
    assert chunks(fits) == [(2, 0, 98)]
    assert fits.prefill_token_num == 98 + 1


def test_mixed_budget_counts_only_decodes_that_got_kv() -> None:
    decode = [decode_req(7), decode_req(8), decode_req(9)]
    plan = StepPlanner(batch_max_tokens=100, mixed=True).plan(decode, [make_req(1, 98)], 2)
    assert ids(plan.decode_reqs) == [7, 8]
    assert ids(plan.kv_starved_decode) == [9]
    assert ids(plan.skipped) == [1]
    assert plan.prefill_token_num == 2


def test_mixed_decodes_beyond_budget_leave_no_prefill_room() -> None:
    decode = [decode_req(i) for i in range(1, 6)]
    plan = StepPlanner(batch_max_tokens=4, mixed=True).plan(decode, [make_req(10, 2)], 100)
    assert len(plan.decode_reqs) == 5
    assert ids(plan.skipped) == [10] and not plan.has_prefill
    assert plan.prefill_token_num == 5


def test_planner_takes_the_classification_it_is_given() -> None:
    # The same single-token requests are decode rows or one-token prefill chunks depending only
    # on the list the classify phase put them in (the normal, strict-prefill and no-decode splits).
    prefix_hit = make_req(1, 30, cur_kv_len=29)
    generated = decode_req(2)
    planner = StepPlanner(batch_max_tokens=10)
    normal = planner.plan([prefix_hit, generated], [], 100)
    assert ids(normal.decode_reqs) == [1, 2] and chunks(normal) == []
    strict = planner.plan([generated], [prefix_hit], 100)
    assert ids(strict.decode_reqs) == [2] and chunks(strict) == [(1, 29, 1)]
    no_decode = planner.plan([], [prefix_hit, generated], 100)
    assert no_decode.decode_reqs == [] and chunks(no_decode) == [(1, 29, 1), (2, 6, 1)]


def test_need_token_num_is_computed_once_per_request(monkeypatch) -> None:
    seen: List[int] = []
    original = step_planner_module.prefill_need_token_num

    def counting(req: InferReq, chunked_prefill_size):
        seen.append(req.request_id)
        return original(req, chunked_prefill_size)

    monkeypatch.setattr(step_planner_module, "prefill_need_token_num", counting)
    prefill = [make_req(1, 80), make_req(2, 80), make_req(3, 10)]
    plan = StepPlanner(batch_max_tokens=100).plan([decode_req(9)], prefill, 1000)
    assert sorted(seen) == [1, 2, 3]
    assert plan.prefill_token_num == 90


def test_request_without_pending_tokens_is_rejected() -> None:
    done = make_req(1, 10, cur_kv_len=10)
    with pytest.raises(ValueError, match="no pending tokens"):
        StepPlanner(batch_max_tokens=64).plan([], [done], 100)


@pytest.mark.parametrize(
    ("kwargs", "param"),
    [
        ({"batch_max_tokens": 0}, "batch_max_tokens"),
        ({"batch_max_tokens": 64.0}, "batch_max_tokens"),
        ({"batch_max_tokens": 64, "chunked_prefill_size": -1}, "chunked_prefill_size"),
        ({"batch_max_tokens": 64, "chunked_prefill_size": 128}, "chunked_prefill_size"),
    ],
)
def test_bad_config_raises(kwargs, param: str) -> None:
    with pytest.raises(ValueError, match=param):
        StepPlanner(**kwargs)


@pytest.mark.parametrize("bad", [-1, 3.5, lambda: -5])
def test_bad_kv_budget_raises(bad) -> None:
    with pytest.raises(ValueError, match="kv_free_tokens"):
        StepPlanner(batch_max_tokens=64).plan([], [make_req(1, 4)], bad)


def test_submit_prefill_advances_counter_only_for_prefill_plans() -> None:
    counter = ProcessedPrefillTokenCounter()
    planner = StepPlanner(batch_max_tokens=100, chunked_prefill_size=64)
    decode_only = planner.plan([decode_req(7)], [], 100)
    assert submit_prefill(decode_only, counter) == 0
    assert counter.value == 0
    mixed_planner = StepPlanner(batch_max_tokens=100, chunked_prefill_size=64, mixed=True)
    mixed_decode_only = mixed_planner.plan([decode_req(7)], [], 100)
    assert mixed_decode_only.prefill_token_num == 1
    assert submit_prefill(mixed_decode_only, counter) == 0 and counter.value == 0
    with_prefill = mixed_planner.plan([decode_req(7)], [make_req(1, 200)], 100)
    assert submit_prefill(with_prefill, counter) == 65
    assert counter.value == 65
    assert chunks(with_prefill) == [(1, 0, 64)]


def test_backend_loop_with_hrrn_accounts_every_submitted_token() -> None:
    """Drive strategy + planner + counter like the backend does, over several chunked rounds."""
    counter = ProcessedPrefillTokenCounter()
    strategy = build_prefill_queue_strategy("hrrn")
    planner = StepPlanner(batch_max_tokens=64, chunked_prefill_size=64)
    queue = [make_req(1, 200, arrival=counter.snapshot())]
    submitted = 0
    served: List[int] = []
    for step in range(12):
        if step == 1:
            queue.append(make_req(2, 30, arrival=counter.snapshot()))
        ordered = strategy.order(queue, counter.value)
        plan = planner.plan([], ordered, 10_000)
        submitted += sum(c.token_num for c in plan.prefill_chunks)
        submit_prefill(plan, counter)
        for chunk in plan.prefill_chunks:
            chunk.req.cur_kv_len = chunk.end
            served.append(chunk.req.request_id)
        queue = [r for r in queue if r.pending_token_num > 0]
        if not queue:
            break
    assert counter.value == submitted == 230
    # Step 1: request 2 has waited 0 tokens (score 0) and 1 is ahead; its 30 tokens do not fit
    # beside a 64-token chunk.  Step 2: 64/30 beats 128/200, so the short prompt runs.
    assert served == [1, 1, 2, 1, 1]


def _prompt(prefix: int, suffix: List[int]) -> List[int]:
    return list(range(prefix)) + suffix


def test_a_chunk_repeating_one_planned_this_step_waits_to_take_it_from_the_cache() -> None:
    """A burst of prompts with a long common prefix computed every chunk of the prefix once per request
    the budget had room for (8 x a 1500-token prefix: 3.2 times the prefix)."""
    planner = StepPlanner(2048, 1024, defer_repeated_chunks=True)
    first = InferReq(request_id=1, prompt_ids=_prompt(1500, [7, 8]))
    same = InferReq(request_id=2, prompt_ids=_prompt(1500, [9]))
    other = InferReq(request_id=3, prompt_ids=[5] + _prompt(1499, [9]))
    plan = planner.plan([], [first, same, other], 100_000)
    assert chunks(plan) == [(1, 0, 1024), (3, 0, 1024)] and [req.request_id for req, _ in plan.deferred] == [2] and plan.skipped == []
    # Next step the repeat has adopted the chunk (cur_kv_len 1024): it is deferred again only
    # while the first request's next chunk covers its tokens.
    same.cur_kv_len = first.cur_kv_len = 1024
    plan = planner.plan([], [first, same], 100_000)
    assert chunks(plan) == [(1, 1024, 478)] and [req.request_id for req, _ in plan.deferred] == [2] and plan.skipped == []
    # Without a prefix cache to adopt from (the default), nothing is deferred.
    plan = StepPlanner(2048, 1024).plan([], [first, same], 100_000)
    assert chunks(plan) == [(1, 1024, 478), (2, 1024, 477)]


def test_the_head_and_requests_that_cannot_take_cached_tokens_are_never_deferred() -> None:
    planner = StepPlanner(2048, 1024, defer_repeated_chunks=True)
    first = InferReq(request_id=1, prompt_ids=_prompt(1500, [7]))
    # A request at another position, or whose whole next chunk is its last token (one token is
    # always computed), runs now.
    later = InferReq(request_id=2, prompt_ids=_prompt(1500, [7]), cur_kv_len=1024)
    short = InferReq(request_id=3, prompt_ids=_prompt(1, []))
    plan = planner.plan([], [first, later, short], 100_000)
    assert plan.deferred == [] and [c[0] for c in chunks(plan)] == [1, 2, 3]


def test_a_shared_prefix_that_ends_inside_the_chunk_defers_when_it_is_half_of_it() -> None:
    planner = StepPlanner(2048, 1024, defer_repeated_chunks=True)
    first = InferReq(request_id=1, prompt_ids=_prompt(1500, list(range(5000, 5020))), cur_kv_len=1024)
    # 476 of its 496 tokens are the first request's: it waits and computes only its own 20 later.
    mostly = InferReq(request_id=2, prompt_ids=_prompt(1500, list(range(6000, 6020))), cur_kv_len=1024)
    # 76 of 496: not worth a step.
    barely = InferReq(request_id=3, prompt_ids=_prompt(1100, list(range(7000, 7420))), cur_kv_len=1024)
    plan = planner.plan([], [first, mostly, barely], 100_000)
    assert [c[0] for c in chunks(plan)] == [1, 3] and [req.request_id for req, _ in plan.deferred] == [2] and plan.skipped == []
