"""A continuation segment samples exactly what the unsplit generation would (issue 9).

A PD master continues a long generation as a new request whose prompt is the original prompt
plus the tokens generated so far, with ``generated_before`` = how many of those trailing prompt
tokens are really output.  Every piece of sampling state that depends on the output so far
(the seeded step index, frequency / presence penalties, the exponential-decay length) must count
them, so a request split after k tokens samples the same next tokens as the unsplit one.  The
field travels from the node request body through the shared-memory record to ``InferReq``.
"""

from __future__ import annotations

import dataclasses
import json
import uuid
from typing import Any, Dict, List

import httpx
import pytest
import torch

from grammar_test_support import run_releasing_grammars
from pd_master_support import Cluster
from pd_node_stand_in import reference_tokens
from lightllm.common.req_manager import ReqManager
from lightllm.common.sampling import SamplingParams
from lightllm.common.sampling.sampler import Sampler
from lightllm.common.sampling.sampling_batch import SamplingBatch
from lightllm.models.registry import load_model
from lightllm.server.http.validation.body import parse_body
from lightllm.server.http.errors import APIError
from lightllm.server.core.objs.shm_req_buffer import ShmReqBuffer
from lightllm.server.pd.node.request_bodies import request_spec_of
from lightllm.server.pd.protocol.stream_lines import DecodeBody, PrefillBody
from lightllm.server.model_rank.kv_cache.infer_context import InferenceContext
from lightllm.server.model_rank.scheduling.prefill_queue_strategy import build_prefill_queue_strategy
from lightllm.server.model_rank.execution.rank_backend import build_rank_backend
from lightllm.server.model_rank.scheduling.step_planner import StepPlanner
from lightllm.server.model_rank.execution.structured_output import GrammarConstraints
from lightllm.server.http.structured.response_format import response_format_grammar
from lightllm.utils.tokenizer_utils import load_tokenizer
from lightllm.server.core.objs.request_spec import RequestSpec, RequestSpecError

MAX_LEN = 200
EOS = 2
NEW_TOKENS = 14

# Seeded sampling with every output-dependent feature on: a hot temperature so that the seeded
# draw decides tokens, strong penalties so that a wrong history changes the distribution, and
# the length decay starting inside the generation.
SEEDED = SamplingParams(
    temperature=1.3,
    seed=1234,
    max_new_tokens=NEW_TOKENS,
    presence_penalty=0.8,
    frequency_penalty=0.6,
    repetition_penalty=1.3,
    exponential_decay_start=3,
    exponential_decay_factor=1.05,
    logprobs=2,
)


def _split(params: SamplingParams, k: int) -> SamplingParams:
    """What the master sends for a continuation after k tokens: the budgets shrink by k."""
    return dataclasses.replace(params, max_new_tokens=params.max_new_tokens - k,
                               min_new_tokens=max(0, params.min_new_tokens - k))


# --- the sampler ---------------------------------------------------------------------------------
def test_split_batch_samples_like_the_unsplit_batch() -> None:
    vocab = 50
    gen = torch.Generator().manual_seed(7)
    prompt = torch.randint(0, vocab, (6,), generator=gen).tolist()
    output = torch.randint(0, 12, (9,), generator=gen).tolist()  # repeats, so the counts matter
    params = [SEEDED, dataclasses.replace(SEEDED, input_penalty=True, seed=99)]
    logits = torch.randn(2, vocab, generator=gen) * 3
    for k in range(1, len(output)):
        whole = SamplingBatch.build(params, [prompt, prompt], [output, output], [EOS], vocab)
        split = SamplingBatch.build(params, [prompt + output[:k]] * 2, [output[k:]] * 2, [EOS], vocab,
                                    generated_before=[k, k])
        assert split.seeded_rows == whole.seeded_rows
        assert torch.equal(split.decay_scales, whole.decay_scales)
        assert sorted(split.counted_cells.tolist()) == sorted(whole.counted_cells.tolist())
        assert sorted(split.seen_cells.tolist()) == sorted(whole.seen_cells.tolist())
        a, b = Sampler(0).sample(logits, whole), Sampler(0).sample(logits, split)
        assert torch.equal(a.next_token_ids, b.next_token_ids) and torch.equal(a.logprobs, b.logprobs)
        # Without generated_before the split row is sampled as a fresh generation: other state.
        naive = SamplingBatch.build(params, [prompt + output[:k]] * 2, [output[k:]] * 2, [EOS], vocab)
        assert naive.seeded_rows != whole.seeded_rows


def test_generated_before_has_one_entry_per_row_and_is_checked_in_the_spec() -> None:
    with pytest.raises(ValueError, match="one entry per row"):
        SamplingBatch.build([SEEDED], [[1, 2]], [[]], [EOS], 8, generated_before=[0, 0])
    # Each value was checked once, by the request's spec (a continuation: segment_index > 0).
    for bad in (2, -1, True, 1.0):
        with pytest.raises(RequestSpecError, match="generated_before must be an int in \\[0, "):
            RequestSpec.build([1, 2], SEEDED, segment_index=1, generated_before=bad)


# --- a model backend -----------------------------------------------------------------------------
@pytest.fixture(scope="module")
def model(tiny_llama_dir):
    return load_model(str(tiny_llama_dir), dtype=torch.float32)


def _run(model, requests: Dict[int, tuple], grammar: Any = None) -> Dict[int, List[int]]:
    """Run ``request_id -> (prompt, params, generated_before)`` on a fresh normal backend."""
    context = InferenceContext(model.new_kv_cache(2048), ReqManager(8, MAX_LEN + 1))
    backend = build_rank_backend("normal", model, context, build_prefill_queue_strategy("default"),
                                 StepPlanner(64, 32), Sampler(0), [EOS], MAX_LEN, grammar=grammar)
    for request_id, (prompt, params, before) in requests.items():
        spec = RequestSpec.build(prompt, params, segment_index=int(before > 0), generated_before=before)
        backend.add_request(request_id, spec)
    return run_releasing_grammars(backend)[0]


def test_a_request_split_at_k_tokens_continues_like_the_unsplit_one(model) -> None:
    gen = torch.Generator().manual_seed(11)
    prompt = torch.randint(5, 1000, (9,), generator=gen).tolist()
    params = dataclasses.replace(SEEDED, min_new_tokens=6)
    full = _run(model, {0: (prompt, params, 0)})[0]
    assert len(full) >= 8, full
    splits = {k: (prompt + full[:k], _split(params, k), k) for k in (1, 3, 5, len(full) - 2)}
    naive = {100 + k: (prompt + full[:k], _split(params, k), 0) for k in splits}
    got = _run(model, {**splits, **naive})  # one batch: rows must not disturb each other
    for k in splits:
        assert got[k] == full[k:], f"split at {k}"
    # The same continuations without generated_before drift away: the check above can fail.
    assert any(got[100 + k] != full[k:] for k in splits)


def test_a_constrained_continuation_resumes_its_grammar_after_the_earlier_output(model, tiny_llama_dir) -> None:
    tokenizer = load_tokenizer(str(tiny_llama_dir))
    schema = {"type": "object", "properties": {"flag": {"type": "boolean"}, "pick": {"enum": ["a", "b"]}},
              "required": ["flag", "pick"], "additionalProperties": False}
    grammar = response_format_grammar({"type": "json_schema", "json_schema": {"name": "s", "schema": schema}})
    params = SamplingParams(temperature=1.0, seed=5, max_new_tokens=40, grammar=grammar)
    prompt = tokenizer("Give me JSON")["input_ids"]
    full = _run(model, {0: (prompt, params, 0)}, GrammarConstraints(lambda: tokenizer))[0]
    assert json.loads(tokenizer.decode(full, skip_special_tokens=True))["pick"] in ("a", "b")
    k = len(full) // 2
    got = _run(model, {1: (prompt + full[:k], _split(params, k), k)}, GrammarConstraints(lambda: tokenizer))
    assert got[1] == full[k:]  # a fresh matcher would have restarted the JSON object


def test_a_spec_refuses_a_generated_before_without_a_prompt_token_left() -> None:
    with pytest.raises(RequestSpecError, match="generated_before must be an int in \\[0, 2\\]"):
        RequestSpec.build([5, 6, 7], SEEDED, segment_index=1, generated_before=3)
    for bad in (-1, True):
        with pytest.raises(RequestSpecError, match="generated_before must be an int"):
            RequestSpec.build([5, 6, 7], SEEDED, segment_index=1, generated_before=bad)


# --- the wire and the shared-memory record --------------------------------------------------------
def _body(**overrides) -> bytes:
    body = {"request_id": 7, "prompt_ids": [3, 4, 5], "params": {"max_new_tokens": 4}, "segment_index": 1,
            "epoch": 0, **overrides}
    return json.dumps(body).encode()


def _spec_of(raw: bytes, body_type: Any) -> RequestSpec:
    return request_spec_of(parse_body(raw, body_type), 1000, MAX_LEN)


def test_node_bodies_carry_a_strictly_checked_generated_before() -> None:
    assert _spec_of(_body(), DecodeBody).segment.generated_before == 0  # default
    assert _spec_of(_body(generated_before=2), DecodeBody).segment.generated_before == 2
    prefill = _spec_of(_body(generated_before=2, kv_start=0, infer_high_priority=-1), PrefillBody)
    assert (prefill.segment.generated_before, prefill.priority.infer_high_priority) == (2, -1)
    cases = [
        (_body(generated_before=3), "less than the prompt length 3"),
        (_body(generated_before=-1), "generated_before must be an int in [0, "),
        (_body(generated_before="1"), "valid integer"),
        (_body(generated_before=True), "valid integer"),
        (_body(generated_before=1.0), "valid integer"),
        (_body(generated_before=1, segment_index=0), "must be 0 for a first segment"),
    ]
    for raw, message in cases:
        for body_type in (DecodeBody, PrefillBody):
            extra = {"kv_start": 0, "infer_high_priority": 0} if body_type is PrefillBody else {}
            data = {**json.loads(raw), **extra}
            with pytest.raises(APIError) as info:
                _spec_of(json.dumps(data).encode(), body_type)
            assert info.value.status_code == 400 and message in str(info.value), str(info.value)
            assert info.value.param == "generated_before"


def test_generated_before_travels_through_the_shared_memory_record() -> None:
    name = f"lightllm_test_{uuid.uuid4().hex[:12]}"
    owner = ShmReqBuffer(name, 2, 32, create=True)
    try:
        spec = RequestSpec.build([1, 2, 3, 4], SamplingParams(max_new_tokens=4), segment_index=1, generated_before=3)
        owner.write_request(0, 41, spec)
        assert owner.read_request(0, 41).segment.generated_before == 3
        # A damaged record no longer reads back as a request (rank 0's screen rejects it).
        owner.array[0]["generated_before"] = 4
        with pytest.raises(RequestSpecError, match="generated_before must be an int in \\[0, 3\\]"):
            owner.read_request(0, 41)
    finally:
        owner.close()
        owner.unlink()


# --- the master ----------------------------------------------------------------------------------
def test_the_master_sends_each_segment_its_generated_before(tiny_llama_dir) -> None:
    cluster = Cluster(str(tiny_llama_dir))
    try:
        cluster.decode.segment_limit = 2  # P's first token + 2 from D: segments of 3, 3, 2
        prompt_ids = cluster.master.manager.served.encode_prompt("a long story")
        response = httpx.post(f"{cluster.master.url}/generate", timeout=30,
                              json={"inputs": "a long story", "parameters": {"max_new_tokens": 8}})
        assert response.status_code == 200, response.text
        expected = reference_tokens(prompt_ids, 8)
        for bodies in (cluster.prefill.bodies, cluster.decode.bodies):
            assert [body["generated_before"] for body in bodies] == [0, 3, 6]
            assert [body["prompt_ids"][len(prompt_ids):] for body in bodies] == [[], expected[:3], expected[:6]]
    finally:
        cluster.stop()
