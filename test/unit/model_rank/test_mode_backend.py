"""The backend step with a real (tiny) model, in one process."""

from __future__ import annotations

import pytest
import torch

from lightllm.common.basemodel.batch_generator import BatchGenerator
from lightllm.common.req_manager import ReqManager
from lightllm.common.sampling import SamplingParams
from lightllm.common.sampling.sampler import Sampler
from lightllm.models.registry import load_model
from lightllm.server.core.objs.finish_status import FINISH_ABORT, FINISH_LENGTH, FINISH_STOP
from lightllm.server.model_rank.kv_cache.infer_context import InferenceContext
from lightllm.server.model_rank.scheduling.backend_registry import ModeBackend
from lightllm.server.model_rank.execution.rank_backend import build_rank_backend
from lightllm.server.model_rank.scheduling.prefill_queue_strategy import build_prefill_queue_strategy
from lightllm.server.model_rank.scheduling.step_planner import StepPlanner
from lightllm.server.core.objs.request_spec import RequestSpec


@pytest.fixture(scope="module")
def model(tiny_llama_dir):
    return load_model(str(tiny_llama_dir), dtype=torch.float32)


def _prompts(n_list, seed=3):
    gen = torch.Generator().manual_seed(seed)
    return [torch.randint(5, 1000, (n,), generator=gen).tolist() for n in n_list]


def _backend(model, kv_tokens, strategy="default", prefix_cache=True, budget=64, chunk=32, mixed=False):
    context = InferenceContext(model.new_kv_cache(kv_tokens), ReqManager(16, 600), use_prefix_cache=prefix_cache)
    return build_rank_backend("normal", model, context, build_prefill_queue_strategy(strategy),
                              StepPlanner(budget, chunk, mixed=mixed), Sampler(0), [2], 600)


def _run(backend):
    outputs, statuses, paused = {}, {}, 0
    while backend.has_work:
        report = backend.step()
        paused += len(report.paused)
        for req, status in report.finished:
            outputs[req.request_id] = list(req.output_ids)
            statuses[req.request_id] = status
    return outputs, statuses, paused


@pytest.mark.parametrize("mixed", [False, True], ids=["separate", "mixed"])
@pytest.mark.parametrize("strategy", ["default", "promote_shortest", "hrrn"])
@pytest.mark.parametrize("kv_tokens", [4096, 300])
def test_outputs_match_plain_greedy_even_under_kv_pressure(model, strategy, kv_tokens, mixed):
    prompts = _prompts([5, 70, 33, 9, 120, 64])
    expected = BatchGenerator(model, 4096).greedy_generate(prompts, 20)
    backend = _backend(model, kv_tokens, strategy, mixed=mixed)
    for i, prompt in enumerate(prompts):
        backend.add_request(i, RequestSpec(prompt, SamplingParams(temperature=0, max_new_tokens=20, ignore_eos=True)))
    forwards_per_step, forward = [], model.forward

    def counting_forward(*args, **kwargs):
        forwards_per_step[-1] += 1
        return forward(*args, **kwargs)

    step = backend.step

    def counting_step():
        forwards_per_step.append(0)
        report = step()
        if report.decode_batch_size and report.prefill_token_num:
            forwards_per_step[-1] = -forwards_per_step[-1]  # a step that ran both kinds of work
        return report

    model.forward, backend.step = counting_forward, counting_step
    try:
        outputs, statuses, paused = _run(backend)
    finally:
        model.forward = forward
    both = [n for n in forwards_per_step if n < 0]
    assert both, "the workload must have steps with decode rows and prefill chunks"
    # Mixed: one forward carries both (its prefill tokens count the decode rows too); else two.
    assert set(both) == ({-1} if mixed else {-2})
    assert [outputs[i] for i in range(len(prompts))] == expected
    assert set(statuses.values()) == {FINISH_LENGTH}
    if kv_tokens == 300:
        assert paused > 0  # the small cache forced requests to pause and resume
    context = backend.kv
    assert context.allocatable_token_num() == kv_tokens
    assert context.clear_prefix_cache() >= 0 and context.kv_cache.available == kv_tokens


def test_prefix_cache_hit_skips_cached_tokens_and_keeps_outputs(model):
    prompt = _prompts([200])[0]
    backend = _backend(model, 4096)
    backend.add_request(1, RequestSpec(prompt + [7], SamplingParams(temperature=0, max_new_tokens=4, ignore_eos=True)))
    first, _, _ = _run(backend)
    counter_before = backend.counter.value
    req = backend.add_request(2, RequestSpec(prompt + [9, 11],
                                             SamplingParams(temperature=0, max_new_tokens=4, ignore_eos=True)))
    assert req.prompt_cache_len == 200
    second, _, _ = _run(backend)
    assert backend.counter.value - counter_before == 2  # only the uncached tokens were prefilled
    fresh = _backend(model, 4096, prefix_cache=False)
    fresh.add_request(2, RequestSpec(prompt + [9, 11], SamplingParams(temperature=0, max_new_tokens=4,
                                                                      ignore_eos=True)))
    assert _run(fresh)[0][2] == second[2]


def test_stop_ids_eos_and_abort(model):
    backend = _backend(model, 4096)
    probe = _backend(model, 4096)
    probe.add_request(0, RequestSpec([5, 6, 7], SamplingParams(temperature=0, max_new_tokens=3, ignore_eos=True)))
    first_token = _run(probe)[0][0][0]
    backend.add_request(1, RequestSpec([5, 6, 7], SamplingParams(temperature=0, max_new_tokens=10,
                                                                 stop_token_ids=[first_token])))
    backend.add_request(2, RequestSpec([8, 9], SamplingParams(temperature=0, max_new_tokens=50, ignore_eos=True)))
    report = backend.step()
    assert [(req.request_id, list(req.output_ids), status) for req, status in report.finished] == [
        (1, [first_token], FINISH_STOP)
    ]
    backend.abort(2)
    outputs, statuses, _ = _run(backend)
    assert statuses[2] == FINISH_ABORT
    assert backend.kv.allocatable_token_num() == 4096


def test_prefill_counter_advances_only_with_prefill(model):
    backend = _backend(model, 4096, strategy="hrrn", budget=32, chunk=32)
    backend.add_request(1, RequestSpec(_prompts([50])[0],
                                       SamplingParams(temperature=0, max_new_tokens=5, ignore_eos=True)))
    seen = []
    while backend.has_work:
        report = backend.step()
        seen.append((report.prefill_token_num, backend.counter.value))
    assert [p for p, _ in seen if p] == [32, 18]
    assert seen[-1][1] == 50  # decode-only steps added nothing


def test_overcommitted_partial_prefills_do_not_deadlock(model):
    # Three 200-token prompts in a 300-token cache: chunks fill the cache before any prompt
    # completes; the backend must pause one holder so the rest can finish.
    prompts = _prompts([200, 200, 200], seed=5)
    expected = BatchGenerator(model, 4096).greedy_generate(prompts, 3)
    backend = _backend(model, 300, prefix_cache=False, budget=96, chunk=32)
    for i, prompt in enumerate(prompts):
        backend.add_request(i, RequestSpec(prompt, SamplingParams(temperature=0, max_new_tokens=3, ignore_eos=True)))
    outputs, _, paused = _run(backend)
    assert paused > 0
    assert [outputs[i] for i in range(3)] == expected


def test_a_burst_of_same_prefix_prompts_does_not_compute_the_prefix_per_request(model):
    """Requests still waiting adopt the prefix others computed meanwhile, not only after they end."""
    prefix = _prompts([192], seed=21)[0]
    tails = _prompts([5, 7, 3, 9, 6, 4], seed=22)
    prompts = [prefix + tail for tail in tails]
    params = SamplingParams(temperature=0, max_new_tokens=4, ignore_eos=True)
    shared = _backend(model, 4096, budget=64, chunk=32)
    for i, prompt in enumerate(prompts):
        shared.add_request(i, RequestSpec(prompt, params))
    outputs, _, _ = _run(shared)
    computed = shared.counter.value
    # The budget (64) holds two 32-token chunks, so the first two requests compute each prefix
    # chunk side by side; every later request adopts the prefix and computes little beyond its
    # tail.  Without sharing each request computes its whole prompt (1186 tokens here).
    assert computed <= 2 * len(prefix) + sum(len(t) for t in tails) + 64
    unshared = _backend(model, 4096, prefix_cache=False, budget=64, chunk=32)
    for i, prompt in enumerate(prompts):
        unshared.add_request(i, RequestSpec(prompt, params))
    expected, _, _ = _run(unshared)
    assert unshared.counter.value == sum(len(p) for p in prompts)
    assert outputs == expected
    context = shared.kv
    assert context.allocatable_token_num() == 4096
    assert context.clear_prefix_cache() >= 0 and context.kv_cache.available == 4096
