"""Many requests through the backend leave its Python-level state bounded (no per-request residue).

Memory growth of a serving process under load shows first as structures that keep something per
request: request maps, prefix-match bookkeeping, request rows, KV slots, sampler and metric
state.  This drives rounds of finished, stopped and aborted requests through a real backend and checks that
each structure returns to its idle size and that the number of live Python objects stops growing
once the prefix cache is full.  It never looks at RSS (that is the soak script's job).
"""

from __future__ import annotations

import gc
import random

import pytest
import torch

from lightllm.common.req_manager import ReqManager
from lightllm.common.sampling import SamplingParams
from lightllm.common.sampling.sampler import Sampler
from lightllm.models.registry import load_model
from lightllm.server.model_rank.kv_cache.infer_context import InferenceContext
from lightllm.server.model_rank.scheduling.backend_registry import ModeBackend
from lightllm.server.model_rank.execution.rank_backend import build_rank_backend
from lightllm.server.model_rank.scheduling.prefill_queue_strategy import build_prefill_queue_strategy
from lightllm.server.model_rank.prefill_wait_tracker import PrefillWaitTracker
from lightllm.server.model_rank.scheduling.step_planner import StepPlanner
from lightllm.server.core.objs.request_spec import RequestSpec

KV_TOKENS = 1024
ROWS = 16
PER_ROUND = 48


@pytest.fixture(scope="module")
def backend(tiny_llama_dir):
    model = load_model(str(tiny_llama_dir), dtype=torch.float32)
    context = InferenceContext(model.new_kv_cache(KV_TOKENS), ReqManager(ROWS, 300), use_prefix_cache=True)
    return build_rank_backend("normal", model, context, build_prefill_queue_strategy("default"), StepPlanner(256, 64), Sampler(0), [2], 300)


def _run_round(backend: ModeBackend, round_index: int, tracker: PrefillWaitTracker) -> None:
    """PER_ROUND requests, at most ROWS at a time: plain, seeded-sampled, stop-id and aborted ones.

    ``tracker`` (the rank's prefill-wait metric state) is fed as the rank process feeds it.
    """
    rng = random.Random(round_index)
    first_id = round_index * PER_ROUND
    pending = list(range(first_id, first_id + PER_ROUND))
    while pending or backend.has_work:
        while pending and len(backend.requests) < ROWS:
            rid = pending.pop()
            prompt = [rng.randrange(5, 1000) for _ in range(rng.randint(3, 40))]
            kind = rid % 4
            params = SamplingParams(
                temperature=0.0 if kind != 1 else 0.8,
                seed=rid if kind == 1 else None,
                max_new_tokens=6,
                ignore_eos=True,
                stop_token_ids=[rng.randrange(5, 1000)] if kind == 2 else [],
            )
            tracker.on_arrival(backend.add_request(rid, RequestSpec(prompt, params)))
        report = backend.step()
        tracker.on_step((r for r, _, _ in report.tokens), (r for r, _ in report.finished),
                        backend.requests.values(), backend.counter.value)
        for rid, req in list(backend.requests.items()):
            if rid % 4 == 3 and req.output_ids:  # walk away after the first token
                backend.abort(rid)


def _assert_idle_state(backend: ModeBackend) -> None:
    context = backend.kv
    assert backend.requests == {} and context._match == {}
    assert not backend.has_work  # nothing left to report: no ended request, no carried token
    assert context.req_manager.available == ROWS
    cached = context.radix_cache.total_token_num
    assert cached <= KV_TOKENS
    # Every allocated slot belongs to the prefix cache: no request left any behind.
    assert context.kv_cache.allocator.used == cached
    assert context.allocatable_token_num() == KV_TOKENS
    assert len(backend.executor.sampler._generators) <= 1


def test_rounds_of_requests_leave_every_structure_at_its_idle_size(backend):
    object_counts = []
    tracker = PrefillWaitTracker()
    for round_index in range(5):
        _run_round(backend, round_index, tracker)
        _assert_idle_state(backend)
        assert tracker._arrival_s == {}  # no request's arrival time outlives it
        gc.collect()
        object_counts.append(len(gc.get_objects()))
    # The cache is full after the first rounds; from then on entries are replaced, not added.
    assert backend.kv.radix_cache.total_token_num > KV_TOKENS // 2
    growth = object_counts[-1] - object_counts[1]
    assert growth < 500, f"live Python objects grew by {growth} over 3 rounds of {PER_ROUND} requests: {object_counts}"


def test_clearing_the_prefix_cache_returns_every_slot(backend):
    _run_round(backend, 99, PrefillWaitTracker())
    backend.kv.clear_prefix_cache()
    assert backend.kv.kv_cache.available == KV_TOKENS
    assert backend.kv.radix_cache.total_token_num == 0
