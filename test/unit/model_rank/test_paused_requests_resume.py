"""Paused requests under an over-committed KV cache: they wait for room a departure frees.

Requests that join together and outgrow the cache pause (decode rows that find no KV give theirs
back).  A paused request used to rejoin as soon as its own freed room fitted it, starve the
requests it paused for, and pause again: a burst computed about 20-25x its prompt tokens here
(10x on a real server at ``--router_token_ratio 2``).  The simulator's engine is the server's
(``test_step_engine_equivalence``), so this drives it with a token-count KV view.
"""

from __future__ import annotations

import random

import pytest

from lightllm.benchmark.simulator.cost_executor import CostModelExecutor
from lightllm.benchmark.simulator.cost_model import load_profile
from lightllm.server.model_rank.scheduling.backend_registry import build_backend
from lightllm.server.model_rank.scheduling.infer_req import InferReq
from lightllm.server.model_rank.scheduling.kv_view import TokenCountKvView
from lightllm.server.model_rank.scheduling.prefill_queue_strategy import build_prefill_queue_strategy
from lightllm.server.model_rank.scheduling.prefill_queue_strategy.overtake_bound import OvertakeBoundSpec
from lightllm.server.model_rank.scheduling.request_state import ReqState
from lightllm.server.model_rank.scheduling.step_planner import StepPlanner

KV_TOKENS = 600


def _overflowing_burst(strategy: str, seed: int):
    backend = build_backend("normal")(
        CostModelExecutor(load_profile("h100_qwen_0p8b")), TokenCountKvView(KV_TOKENS),
        build_prefill_queue_strategy(strategy, OvertakeBoundSpec(2048, 0.15)), StepPlanner(128, 128), [], KV_TOKENS)
    rng = random.Random(seed)
    lengths = {}
    for request_id in range(24):
        prompt_len, max_new = rng.randint(40, 500), rng.randint(8, 90)
        lengths[request_id] = (prompt_len, max_new)
        backend.join(InferReq(request_id, [0] * prompt_len, max_new_tokens=max_new,
                              arrival_processed_prefill_tokens=backend.counter.snapshot()))
    return backend, lengths


@pytest.mark.parametrize("strategy", ["default", "hrrn"])
@pytest.mark.parametrize("seed", [0, 1])
def test_an_overflowing_burst_computes_its_prompts_a_few_times_not_dozens(strategy: str, seed: int) -> None:
    backend, lengths = _overflowing_burst(strategy, seed)
    computed = paused = steps = 0
    generated = {}
    while backend.has_work:
        report = backend.step()
        computed += report.prefill_token_num
        paused += len(report.paused)
        for req, _ in report.finished:
            generated[req.request_id] = len(req.output_ids)
        steps += 1
        assert steps < 20_000, "the burst did not drain"
    assert paused > 0  # the cache was over-committed
    assert generated == {request_id: max_new for request_id, (_, max_new) in lengths.items()}
    prompts = sum(prompt_len for prompt_len, _ in lengths.values())
    # Recomputing a paused request's tokens is the price of pausing; 20x-26x before the rule.
    assert computed < 5 * prompts, (computed, prompts)
    assert backend.kv.used == 0


def test_no_request_starts_while_a_paused_one_waits_and_others_run() -> None:
    backend, _ = _overflowing_burst("default", 0)
    checked = 0
    while backend.has_work:
        waiting = {rid for rid, req in backend.requests.items() if req.state is ReqState.WAITING}
        paused = {rid for rid, req in backend.requests.items() if req.state is ReqState.PAUSED}
        report = backend.step()
        still_paused = {rid for rid in paused if rid in backend.requests
                        and backend.requests[rid].state is ReqState.PAUSED and backend.requests[rid] not in report.paused}
        started = [req for req in report.ordered if req.request_id not in waiting]
        if still_paused and started:
            assert not waiting & {req.request_id for req in report.ordered}
            checked += 1
    assert checked > 0


@pytest.mark.parametrize("seed", [0, 1, 2, 3])
def test_paused_requests_resumed_together_do_not_share_the_same_room(seed: int) -> None:
    # Twelve requests that each grow to half the cache (prompt + max_new_tokens = 1024 of 2048),
    # as an outside pass sent them with the prefix cache off. Several paused ones resumed in one
    # step, each seeing the same free room (resuming allocates nothing until they compute), ran
    # dry together and paused again: 35-118x the prompts computed here (35-87x on a real server).
    kv_tokens = 2048
    backend = build_backend("normal")(
        CostModelExecutor(load_profile("h100_qwen_0p8b")), TokenCountKvView(kv_tokens),
        build_prefill_queue_strategy("default", OvertakeBoundSpec(2048, 0.15)), StepPlanner(2048, 1024), [],
        kv_tokens)
    rng = random.Random(seed)
    prompts = 0
    for request_id in range(12):
        prompt_len = rng.randint(300, 800)
        prompts += prompt_len
        backend.join(InferReq(request_id, [0] * prompt_len, max_new_tokens=1024 - prompt_len,
                              arrival_processed_prefill_tokens=backend.counter.snapshot()))
    computed = finished = steps = 0
    while backend.has_work:
        report = backend.step()
        computed += report.prefill_token_num
        finished += len(report.finished)
        steps += 1
        assert steps < 20_000, "the burst did not drain"
    assert finished == 12 and backend.kv.used == 0
    assert computed < 6 * prompts, (computed, prompts)
