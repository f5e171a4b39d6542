"""End to end on the tiny model: prefill on one backend, real KV transfer processes, decode on another.

The prompts' KV leaves the prefill backend's cache through its transfer process and lands in
the slots the decode backend reserved; the decode backend's greedy tokens must equal a normal
node's.  Both backends keep stepping while transfers are in flight (nothing waits on them).
"""

from __future__ import annotations

import time
from typing import Dict, List

import torch

from lightllm.common.basemodel.batch_generator import BatchGenerator
from lightllm.common.req_manager import ReqManager
from lightllm.common.sampling import SamplingParams
from lightllm.common.sampling.sampler import Sampler
from lightllm.models.registry import load_model
from lightllm.server.core.objs.finish_status import FINISH_HANDED_OFF, FINISH_LENGTH
from lightllm.server.model_rank.kv_cache.infer_context import InferenceContext
from lightllm.server.model_rank.scheduling.infer_req import InferReq
from lightllm.server.model_rank.scheduling.prefill_queue_strategy import build_prefill_queue_strategy
from lightllm.server.model_rank.execution.rank_backend import build_rank_backend
from lightllm.server.model_rank.scheduling.step_planner import StepPlanner
from lightllm.server.core.objs.request_spec import RequestSpec

from pd_kv_transfer_support import start_pair

MAX_LEN = 400


def _backend(model, run_mode: str):
    cache = model.new_kv_cache(2048)
    cache.share_buffers()
    context = InferenceContext(cache, ReqManager(8, MAX_LEN + 1))
    return build_rank_backend(run_mode, model, context, build_prefill_queue_strategy("hrrn"),
                              StepPlanner(64, 32), Sampler(0), [2], MAX_LEN)


def test_prefill_real_transfer_decode_matches_a_normal_node(tiny_llama_dir) -> None:
    model = load_model(str(tiny_llama_dir), dtype=torch.float32)
    gen = torch.Generator().manual_seed(11)
    prompts = [torch.randint(5, 1000, (n,), generator=gen).tolist() for n in (9, 70, 130, 33, 64)]
    max_new = 10
    expected = BatchGenerator(model, 4096).greedy_generate(prompts, max_new)
    prefill, decode = _backend(model, "prefill"), _backend(model, "decode")
    prefill_free, decode_free = prefill.kv.allocatable_token_num(), decode.kv.allocatable_token_num()
    sender, receiver = start_pair(prefill.kv.kv_cache, decode.kv.kv_cache, page_size=32, timeout_s=20.0)
    try:
        params = SamplingParams(temperature=0, max_new_tokens=max_new, ignore_eos=True)
        for i, prompt in enumerate(prompts):
            prefill.add_request(i, RequestSpec(prompt, params))
        waiting: Dict[int, tuple[InferReq, int]] = {}  # decode-side request and P's first token
        outputs: Dict[int, List[int]] = {}
        handed_off: List[int] = []
        deadline = time.monotonic() + 120
        while len(outputs) < len(prompts):
            assert time.monotonic() < deadline, f"stuck: outputs {sorted(outputs)}, waiting {sorted(waiting)}"
            if prefill.has_work:
                report = prefill.step()
                for req in report.handoffs:
                    dst = decode.reserve_prefilled(req.request_id, RequestSpec(list(req.prompt_ids), params))
                    start, end = dst.cur_kv_len, dst.input_len
                    receiver.receive(req.request_id, decode.kv.slots(dst, start, end))
                    sender.send(req.request_id, prefill.kv.slots(req, start, end), req.output_ids[0])
                    waiting[req.request_id] = (dst, req.output_ids[0])
                for req, status in report.finished:
                    assert status == FINISH_HANDED_OFF
                    handed_off.append(req.request_id)
            for result in receiver.poll():
                assert result.ok, result.reason
                dst, first_token = waiting.pop(result.request_id)
                assert result.first_token == first_token  # arrived in the transfer header
                assert decode.admit_prefilled(dst, result.first_token) == 0
            for result in sender.poll():
                assert result.ok and result.bytes > 0, result.reason
                prefill.transfer_done(result.request_id, ok=True)
            if decode.has_work:
                for req, status in decode.step().finished:
                    assert status == FINISH_LENGTH
                    outputs[req.request_id] = list(req.output_ids)
            else:
                time.sleep(0.002)
        # The receiver can finish before the sender's acknowledgement arrives, so P may still hold
        # a request whose transfer is unconfirmed: keep polling the sender until P is empty.
        while prefill.has_work:
            assert time.monotonic() < deadline, f"prefill never released: handed off {sorted(handed_off)}"
            for result in sender.poll():
                assert result.ok and result.bytes > 0, result.reason
                prefill.transfer_done(result.request_id, ok=True)
            handed_off += [req.request_id for req, _ in prefill.step().finished]
            time.sleep(0.002)
        assert [outputs[i] for i in range(len(prompts))] == expected
        assert sorted(handed_off) == list(range(len(prompts)))
        assert prefill.kv.allocatable_token_num() == prefill_free
        assert decode.kv.allocatable_token_num() == decode_free
    finally:
        sender.close()
        receiver.close()
