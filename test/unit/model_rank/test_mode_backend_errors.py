"""One bad request never stops the rank: it finishes with FINISH_ERROR and the others go on.

Real tiny model, real KV cache and sampler, in one process (as test_mode_backend.py); the
failures are real ones (invalid parameters, an out-of-vocabulary token reaching the embedding).
"""

from __future__ import annotations

import uuid

import pytest
import torch

from lightllm.common.basemodel.batch_generator import BatchGenerator
from lightllm.common.req_manager import ReqManager
from lightllm.common.sampling import SamplingParams
from lightllm.common.sampling.sampler import Sampler
from lightllm.models.registry import load_model
from lightllm.server.core.objs.finish_status import FINISH_ERROR, FINISH_LENGTH, FINISH_REASON_NAMES
from lightllm.server.core.objs.io_messages import AbortRequest, AddRequests, DetokenizedOutput, SlotReleased, StepOutput, StepTexts
from lightllm.server.core.objs.shm_req_buffer import ShmReqBuffer
from lightllm.server.model_rank.kv_cache.infer_context import InferenceContext
from lightllm.server.model_rank.scheduling.admission import RequestRejected
from lightllm.server.model_rank.execution.rank_backend import build_rank_backend
from lightllm.server.model_rank.execution.torch_executor import MAX_CONSECUTIVE_FORWARD_FAILURES
from lightllm.server.model_rank.scheduling.prefill_queue_strategy import build_prefill_queue_strategy
from lightllm.server.model_rank.scheduling.step_planner import StepPlanner
from lightllm.server.model_rank.rank_process import ModelRank, RejectRequests
from lightllm.server.core.objs.request_spec import RequestSpec

from detokenizer_test_support import detokenizer_rig

KV_TOKENS = 2048
MAX_LEN = 600


@pytest.fixture(scope="module")
def model(tiny_llama_dir):
    return load_model(str(tiny_llama_dir), dtype=torch.float32)


def _backend(model, token_sync=None):
    context = InferenceContext(model.new_kv_cache(KV_TOKENS), ReqManager(16, MAX_LEN))
    return build_rank_backend("normal", model, context, build_prefill_queue_strategy("default"), StepPlanner(256, 64), Sampler(0),
                       [2], MAX_LEN, token_sync=token_sync)


def _prompts(n_list, seed=11):
    gen = torch.Generator().manual_seed(seed)
    return [torch.randint(5, 1000, (n,), generator=gen).tolist() for n in n_list]


def _greedy(max_new=6):
    return SamplingParams(temperature=0, max_new_tokens=max_new, ignore_eos=True)


def _run(backend, max_steps=200):
    outputs, statuses = {}, {}
    for _ in range(max_steps):
        if not backend.has_work:
            break
        report = backend.step()
        for req, status in report.finished:
            outputs[req.request_id] = list(req.output_ids)
            statuses[req.request_id] = status
    assert not backend.has_work
    return outputs, statuses


def _assert_kv_all_back(backend):
    context = backend.kv
    assert context.allocatable_token_num() == KV_TOKENS
    context.clear_prefix_cache()
    assert context.kv_cache.available == KV_TOKENS
    assert not backend.requests


def test_error_finish_status_has_a_reason_name():
    assert FINISH_REASON_NAMES[FINISH_ERROR] == "error"


def test_invalid_request_is_rejected_alone_at_admission(model):
    prompts = _prompts([12, 30])
    expected = BatchGenerator(model, 4096).greedy_generate(prompts, 6)
    backend = _backend(model)
    backend.add_request(1, RequestSpec(prompts[0], _greedy()))
    poisoned = _greedy()
    poisoned.top_p = 0.0  # as a damaged shared-memory record would read back
    # Rank 0's screen (check_request) refuses these before any rank admits them.
    with pytest.raises(RequestRejected, match="top_p"):
        backend.check_request(RequestSpec(prompts[1], poisoned))
    with pytest.raises(RequestRejected, match="prompt_ids"):
        backend.check_request(RequestSpec([5, model.config.vocab_size], _greedy()))
    with pytest.raises(RequestRejected, match="max_req_total_len"):
        backend.check_request(RequestSpec([5] * 10, _greedy(MAX_LEN)))
    with pytest.raises(RequestRejected, match="RequestSpec"):
        backend.check_request(([5], _greedy()))
    backend.check_request(RequestSpec(prompts[1], _greedy()))
    for request_id in (2, 3, 4):
        backend.reject(request_id)
    backend.add_request(5, RequestSpec(prompts[1], _greedy()))
    first = backend.step()
    assert [(req.request_id, status) for req, status in first.finished[:3]] == [(2, FINISH_ERROR), (3, FINISH_ERROR),
                                                                                (4, FINISH_ERROR)]
    outputs, statuses = _run(backend)
    assert outputs[1] == expected[0] and outputs[5] == expected[1]
    assert statuses[1] == statuses[5] == FINISH_LENGTH
    _assert_kv_all_back(backend)


def test_a_rejection_alone_is_reported_by_the_next_step(model):
    backend = _backend(model)
    backend.reject(8, shm_index=3)
    assert backend.has_work
    report = backend.step()
    assert [(req.request_id, req.shm_index, status) for req, status in report.finished] == [(8, 3, FINISH_ERROR)]
    assert not report.did_work and not backend.has_work


def test_request_whose_sampling_fails_finishes_with_error_and_others_continue(model):
    prompts = _prompts([9, 40, 17])
    expected = BatchGenerator(model, 4096).greedy_generate(prompts, 6)
    backend = _backend(model)
    reqs = [backend.add_request(i, RequestSpec(prompt, _greedy())) for i, prompt in enumerate(prompts)]
    # Two decode steps in, request 1's parameters go bad: building its sampling batch raises.
    backend.step()
    backend.step()
    assert all(len(req.output_ids) >= 1 for req in reqs)
    produced_before = list(reqs[1].output_ids)
    reqs[1].sampling.min_new_tokens = 6
    reqs[1].sampling.stop_token_ids = [model.config.vocab_size + 7]
    report = backend.step()
    assert [(req.request_id, status) for req, status in report.finished] == [(1, FINISH_ERROR)]
    assert reqs[1].output_ids == produced_before  # no token was made up for the failed row
    assert {req.request_id for req, _, _ in report.tokens} == {0, 2}
    outputs, statuses = _run(backend)
    assert outputs[0] == expected[0] and outputs[2] == expected[2]
    assert statuses == {0: FINISH_LENGTH, 2: FINISH_LENGTH}
    _assert_kv_all_back(backend)


def test_failed_row_is_decided_by_the_shared_tokens(model):
    # Under tensor parallelism rank 0's tokens (with -1 for failed rows) are what every rank
    # follows: a rank whose own sampling succeeded still fails the row rank 0 failed.
    def rank0_failed_row_1(tokens):
        shared = tokens.clone()
        shared[1] = -1
        return shared

    prompts = _prompts([8, 8])
    backend = _backend(model, token_sync=rank0_failed_row_1)
    for i, prompt in enumerate(prompts):
        backend.add_request(i, RequestSpec(prompt, _greedy(1)))
    report = backend.step()
    assert sorted((req.request_id, status) for req, status in report.finished) == [(0, FINISH_LENGTH),
                                                                                  (1, FINISH_ERROR)]
    _assert_kv_all_back(backend)


def test_forward_failure_fails_its_batch_and_the_rank_recovers(model):
    prompts = _prompts([20, 25, 14])
    expected = BatchGenerator(model, 4096).greedy_generate(prompts, 6)
    backend = _backend(model)
    good = backend.add_request(1, RequestSpec(prompts[0], _greedy()))
    bad = backend.add_request(2, RequestSpec(prompts[1], _greedy()))
    # A token id past the embedding table reaches the forward pass: a genuine forward failure.
    bad.prompt_ids[3] = model.config.vocab_size + 1000
    report = backend.step()
    assert sorted((req.request_id, status) for req, status in report.finished) == [(1, FINISH_ERROR),
                                                                                  (2, FINISH_ERROR)]
    assert good.output_ids == []
    _assert_kv_all_back(backend)
    backend.add_request(3, RequestSpec(prompts[2], _greedy()))
    outputs, statuses = _run(backend)
    assert outputs[3] == expected[2] and statuses[3] == FINISH_LENGTH
    _assert_kv_all_back(backend)


def test_forward_failures_in_a_row_or_under_tensor_parallelism_are_raised(model):
    backend = _backend(model)
    for attempt in range(MAX_CONSECUTIVE_FORWARD_FAILURES):
        req = backend.add_request(attempt, RequestSpec([5, 6, 7], _greedy()))
        req.prompt_ids[0] = model.config.vocab_size + 1
        if attempt < MAX_CONSECUTIVE_FORWARD_FAILURES - 1:
            assert backend.step().finished[0][1] == FINISH_ERROR
        else:
            with pytest.raises(Exception):
                backend.step()
    tp_backend = _backend(model, token_sync=lambda tokens: tokens)
    req = tp_backend.add_request(9, RequestSpec([5, 6, 7], _greedy()))
    req.prompt_ids[0] = model.config.vocab_size + 1
    with pytest.raises(Exception):
        tp_backend.step()


def test_rank_screens_records_that_do_not_read_back_valid(model):
    """Rank 0 turns an unreadable record into RejectRequests before broadcasting the commands."""
    shm = ShmReqBuffer(f"lightllm_test_{uuid.uuid4().hex[:12]}", 3, MAX_LEN, create=True)
    try:
        for slot in range(3):
            shm.write_request(slot, 100 + slot, RequestSpec([5, 6, 7, 8], _greedy(3)))
        shm.array[1]["repetition_penalty"] = 0.0  # damaged after the HTTP side validated it
        shm.array[2]["top_k"] = -5
        rank = ModelRank(_backend(model), shm, is_leader=False)  # the command plumbing only; no process, no sockets
        commands = rank.screen([AddRequests([(100, 0), (101, 1), (102, 2)])])
        assert [type(c) for c in commands] == [AddRequests, RejectRequests]
        assert commands[0].requests == [(100, 0)] and commands[1] == RejectRequests([(101, 1), (102, 2)])
        rank.apply(commands)
        outputs, statuses = _run(rank.backend)
        assert statuses == {100: FINISH_LENGTH, 101: FINISH_ERROR, 102: FINISH_ERROR}
        assert len(outputs[100]) == 3
    finally:
        shm.close()
        shm.unlink()


def test_detokenizer_reports_error_status_and_unreadable_records(tiny_llama_dir, tmp_path):
    """FINISH_ERROR reaches the HTTP side as finish reason "error"; a record it cannot decode too."""
    with detokenizer_rig(tiny_llama_dir, tmp_path, 2) as rig:
        shm, manager, http, router = rig.shm, rig.manager, rig.http, rig.router
        shm.write_request(0, 1, RequestSpec([5, 6], _greedy(3)))
        shm.publish_token(0, 1, 42, -0.5)
        shm.set_finish_status(0, 1, FINISH_ERROR)
        shm.write_request(1, 2, RequestSpec([5, 6], _greedy(3)))
        shm.array[1]["stop_sequences_json"] = b"[not json"  # damaged after the HTTP side wrote it
        shm.publish_token(1, 2, 43, -0.5)
        manager.handle(StepOutput([(1, 0, 1), (2, 1, 1)], [(1, 0)]))
        step = http.recv_pyobj()
        assert isinstance(step, StepTexts)  # the whole step in one message
        received = step.messages
        assert len(received) == 3
        assert isinstance(received[0], DetokenizedOutput) and received[0].finish_reason == "error"
        assert [event.token_id for event in received[0].tokens] == [42]
        assert (received[1].request_id, received[1].tokens, received[1].finish_reason) == (2, [], "error")
        assert received[2] == SlotReleased(1, 0)  # no second "abort" message for the failed request
        assert router.recv_pyobj() == AbortRequest(2)  # the rank stops generating for it
        manager.handle(StepOutput([(2, 1, 1)], [(2, 1)]))
        assert http.recv_pyobj() == StepTexts([SlotReleased(2, 1)])
        assert not http.poll(100)
