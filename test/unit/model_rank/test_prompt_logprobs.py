"""Prompt logprobs from the prefill forward: chunked, batched, behind a prefix-cache hit, under KV pressure."""

from __future__ import annotations

import pytest
import torch
from transformers import AutoModelForCausalLM

from lightllm.common.req_manager import ReqManager
from lightllm.common.sampling import SamplingParams
from lightllm.common.sampling.sampler import Sampler
from lightllm.models.registry import load_model
from lightllm.server.model_rank.kv_cache.infer_context import InferenceContext
from lightllm.server.model_rank.scheduling.backend_registry import ModeBackend
from lightllm.server.model_rank.execution.rank_backend import build_rank_backend
from lightllm.server.model_rank.scheduling.prefill_queue_strategy import build_prefill_queue_strategy
from lightllm.server.model_rank.scheduling.step_planner import StepPlanner
from lightllm.server.core.objs.request_spec import RequestSpec


@pytest.fixture(scope="module")
def model(tiny_llama_dir):
    return load_model(str(tiny_llama_dir), dtype=torch.float32)


@pytest.fixture(scope="module")
def hf_model(tiny_llama_dir):
    return AutoModelForCausalLM.from_pretrained(str(tiny_llama_dir), dtype=torch.float32).eval()


def _backend(model, kv_tokens: int, chunk: int) -> ModeBackend:
    context = InferenceContext(model.new_kv_cache(kv_tokens), ReqManager(16, 600), use_prefix_cache=True)
    return build_rank_backend("normal", model, context, build_prefill_queue_strategy("default"), StepPlanner(2 * chunk, chunk),
                       Sampler(0), [2], 600)


def _collect(backend: ModeBackend) -> dict[int, list]:
    entries: dict[int, list] = {}
    while backend.has_work:
        report = backend.step()
        for req, computed in report.prompt_logprobs:
            entries.setdefault(req.request_id, []).extend(computed)
    return entries


@pytest.mark.parametrize("kv_tokens", [4096, 120])
def test_prompt_logprobs_match_a_full_forward(model, hf_model, kv_tokens):
    gen = torch.Generator().manual_seed(5)
    shared = torch.randint(5, 1000, (20,), generator=gen).tolist()
    prompts = [shared + torch.randint(5, 1000, (n,), generator=gen).tolist() for n in (17, 3, 30)]
    backend = _backend(model, kv_tokens, chunk=8)
    # Warm the prefix cache with the shared prefix, so the later requests could hit it.
    backend.add_request(1, RequestSpec(shared + [7], SamplingParams(temperature=0, max_new_tokens=2)))
    _collect(backend)
    asked = {10: 3, 11: None, 12: 0}
    for (request_id, count), prompt in zip(asked.items(), prompts):
        backend.add_request(request_id, RequestSpec(prompt, SamplingParams(temperature=0, max_new_tokens=4, ignore_eos=True,
                                                               prompt_logprobs=count)))
    entries = _collect(backend)
    assert 11 not in entries
    for (request_id, count), prompt in zip(asked.items(), prompts):
        if count is None:
            continue
        with torch.no_grad():
            reference = torch.log_softmax(hf_model(torch.tensor([prompt])).logits[0, :-1].float(), dim=-1)
        got = entries[request_id]
        # Every position exactly once, in order, even when a pause made the request prefill again.
        assert [position for position, _, _, _ in got] == list(range(1, len(prompt)))
        for position, logprob, top, rank in got:
            row = reference[position - 1]
            assert logprob == pytest.approx(float(row[prompt[position]]), abs=2e-3)
            # vLLM's rank: 1 + how many tokens are strictly more likely than the prompt token.
            # Two float32 forwards differ in the last bits: a token within 1e-4 may sit on either side.
            value = row[prompt[position]]
            assert 1 + int((row > value + 1e-4).sum()) <= rank <= 1 + int((row > value - 1e-4).sum())
            assert [token_id for token_id, _ in top] == row.topk(count).indices.tolist() if count else top == []
