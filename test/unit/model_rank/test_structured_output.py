"""Grammar-constrained decoding in the model backend, in process with the tiny model."""

from __future__ import annotations

import json

import jsonschema
import pytest
import torch

from lightllm.common.req_manager import ReqManager
from lightllm.common.sampling import SamplingParams
from lightllm.common.sampling.sampler import Sampler
from lightllm.models.registry import load_model
from lightllm.server.http.structured.response_format import response_format_grammar
from lightllm.server.http.structured.structured_params import structured_grammar
from lightllm.server.core.objs.finish_status import FINISH_GRAMMAR_FAILED, FINISH_STOP
from lightllm.server.model_rank.kv_cache.infer_context import InferenceContext
from lightllm.server.model_rank.scheduling.admission import RequestRejected
from lightllm.server.model_rank.execution.rank_backend import build_rank_backend
from lightllm.server.model_rank.scheduling.prefill_queue_strategy import build_prefill_queue_strategy
from lightllm.server.model_rank.scheduling.step_planner import StepPlanner
from lightllm.server.model_rank.execution.structured_output import GrammarConstraints
from lightllm.utils.tokenizer_utils import load_tokenizer
from lightllm.server.core.objs.request_spec import RequestSpec

from grammar_test_support import run_releasing_grammars

SCHEMA = {"type": "object", "properties": {"flag": {"type": "boolean"}, "pick": {"enum": ["a", "b"]}},
          "required": ["flag", "pick"], "additionalProperties": False}


def _backend(model, grammar):
    context = InferenceContext(model.new_kv_cache(4096), ReqManager(16, 600), use_prefix_cache=True)
    return build_rank_backend("normal", model, context, build_prefill_queue_strategy("default"), StepPlanner(64, 32), Sampler(0), [2],
                       600, grammar=grammar)


def _run(backend):
    return run_releasing_grammars(backend)


def test_constrained_rows_follow_the_schema_and_free_rows_do_not_change(tiny_llama_dir):
    model = load_model(str(tiny_llama_dir), dtype=torch.float32)
    tokenizer = load_tokenizer(str(tiny_llama_dir))
    grammar = response_format_grammar({"type": "json_schema", "json_schema": {"name": "s", "schema": SCHEMA}})
    free = SamplingParams(temperature=0, max_new_tokens=10, ignore_eos=True)
    prompt = tokenizer("Give me JSON")["input_ids"]
    alone, _ = _run_one(model, free, prompt)
    backend = _backend(model, GrammarConstraints(lambda: tokenizer))
    backend.add_request(1, RequestSpec(prompt, free))
    for request_id, seed in ((2, 1), (3, 2)):
        backend.add_request(request_id, RequestSpec(prompt, SamplingParams(temperature=1.0, seed=seed, max_new_tokens=40,
                                                                           grammar=grammar)))
    outputs, statuses = _run(backend)
    assert outputs[1] == alone
    for request_id in (2, 3):
        assert statuses[request_id] == FINISH_STOP
        jsonschema.validate(json.loads(tokenizer.decode(outputs[request_id], skip_special_tokens=True)), SCHEMA)


def _run_one(model, params, prompt):
    backend = _backend(model, None)
    backend.add_request(1, RequestSpec(prompt, params))
    outputs, statuses = _run(backend)
    return outputs[1], statuses[1]


def test_a_rank_without_grammar_support_rejects_constrained_requests(tiny_llama_dir):
    model = load_model(str(tiny_llama_dir), dtype=torch.float32)
    grammar = response_format_grammar({"type": "json_object"})
    with pytest.raises(RequestRejected, match="structured output"):
        # Rank 0's screen runs this on every record before any rank admits the request.
        _backend(model, None).check_request(RequestSpec([1, 5, 6], SamplingParams(max_new_tokens=4, grammar=grammar)))


def test_a_finished_grammar_ends_with_the_servers_own_end_of_sequence_id(tiny_llama_dir):
    """With --eos_id (or a chat end-of-turn id) the grammar must end on an id the server stops at,
    not only on the tokenizer's eos_token."""
    model = load_model(str(tiny_llama_dir), dtype=torch.float32)
    tokenizer = load_tokenizer(str(tiny_llama_dir))
    im_end = tokenizer.convert_tokens_to_ids("<|im_end|>")
    assert im_end != tokenizer.eos_token_id
    # A grammar that may end after any "ab" or go on: only an end-of-sequence id ends it.
    grammar = structured_grammar({"regex": "(ab)+"}, {}, None)
    context = InferenceContext(model.new_kv_cache(4096), ReqManager(16, 600), use_prefix_cache=True)
    backend = build_rank_backend("normal", model, context, build_prefill_queue_strategy("default"),
                                 StepPlanner(64, 32), Sampler(0), [im_end], 600,
                                 grammar=GrammarConstraints(lambda: tokenizer, [im_end]))
    # The biases make the model want to end, with the tokenizer's eos_token above all, which this
    # server does not stop at: the grammar must offer the server's id instead.
    params = SamplingParams(temperature=0, max_new_tokens=60, grammar=grammar,
                            logit_bias={tokenizer.eos_token_id: 100.0, im_end: 50.0})
    backend.add_request(1, RequestSpec(tokenizer("JSON please")["input_ids"], params))
    outputs, statuses = _run(backend)
    assert statuses[1] == FINISH_STOP and outputs[1][-1] == im_end
    text = tokenizer.decode(outputs[1][:-1], skip_special_tokens=True)
    assert text and text == "ab" * (len(text) // 2)



def test_an_empty_regex_ends_the_output_at_once_with_the_end_of_sequence_id(tiny_llama_dir):
    """``regex: ""`` matches the empty text only (it was refused as "must be a non-empty string"; vLLM
    answers it): the first token is the end-of-sequence id, even with min_tokens asking for more."""
    model = load_model(str(tiny_llama_dir), dtype=torch.float32)
    tokenizer = load_tokenizer(str(tiny_llama_dir))
    eos = tokenizer.eos_token_id
    grammar = structured_grammar({"regex": ""}, {}, None)
    backend = _backend(model, GrammarConstraints(lambda: tokenizer, [eos]))
    params = SamplingParams(temperature=1.0, seed=3, max_new_tokens=20, min_new_tokens=5, grammar=grammar,
                            logit_bias={eos: -100.0})
    backend.add_request(1, RequestSpec(tokenizer("Say nothing")["input_ids"], params))
    outputs, statuses = _run(backend)
    assert statuses[1] == FINISH_STOP and outputs[1] == [eos]


def test_a_grammar_that_fails_ends_its_request_alone_and_says_why(tiny_llama_dir, caplog):
    """A grammar that matches nothing (the HTTP process refuses it; a rank must cope anyway)
    allows no first token, and one that can never end runs into llguidance's limits after its
    first token: each request ends with an error, logged with the reason, instead of sampling
    from an empty row; a free request in the same batch is untouched."""
    import llguidance

    model = load_model(str(tiny_llama_dir), dtype=torch.float32)
    tokenizer = load_tokenizer(str(tiny_llama_dir))
    prompt = tokenizer("Say a")["input_ids"]
    free = SamplingParams(temperature=0, max_new_tokens=6, ignore_eos=True)
    alone, _ = _run_one(model, free, prompt)
    backend = _backend(model, GrammarConstraints(lambda: tokenizer))
    backend.add_request(1, RequestSpec(prompt, free))
    endless = llguidance.grammar_from("lark", 'start: "a" start')
    nothing = llguidance.LLMatcher.grammar_from_regex(r"[^\s\S]")
    for request_id, grammar in ((2, endless), (3, nothing)):
        backend.add_request(request_id, RequestSpec(prompt, SamplingParams(temperature=0, max_new_tokens=6,
                                                                           grammar=grammar)))
    with caplog.at_level("WARNING", logger="lightllm.structured_output"):
        outputs, statuses = _run(backend)
    assert outputs[1] == alone
    assert statuses[2] == FINISH_GRAMMAR_FAILED and len(outputs[2]) < 6
    assert "request 2: token" in caplog.text and "does not continue its structured-output grammar" in caplog.text
    assert statuses[3] == FINISH_GRAMMAR_FAILED and outputs[3] == []
    assert "request 3: its structured-output grammar allows no token after 0 output tokens" in caplog.text


def test_an_ambiguous_grammar_ends_with_an_error_before_its_cost_takes_the_rank(tiny_llama_dir, caplog):
    """``x: x x | x x x | "a" | "aa" | "b"`` needs more parser items with every token, and its mask cost grows with
    them (112 ms a step after 450 tokens under llguidance's default limit), in the step every request
    waits for: under the server's limit it ends after about a hundred tokens; a free request is untouched."""
    import llguidance

    model = load_model(str(tiny_llama_dir), dtype=torch.float32)
    tokenizer = load_tokenizer(str(tiny_llama_dir))
    prompt = tokenizer("Say a")["input_ids"]
    free = SamplingParams(temperature=0, max_new_tokens=300, ignore_eos=True)
    alone, _ = _run_one(model, free, prompt)
    backend = _backend(model, GrammarConstraints(lambda: tokenizer))
    backend.add_request(1, RequestSpec(prompt, free))
    ambiguous = llguidance.grammar_from("lark", 'start: x\nx: x x | x x x | "a" | "aa" | "b"\n')
    a = tokenizer.convert_tokens_to_ids("a")
    # The bias keeps it on the one-byte token, the costliest path (a greedy model would end at once).
    params = SamplingParams(temperature=0, max_new_tokens=300, min_new_tokens=300, grammar=ambiguous,
                            logit_bias={a: 100.0})
    backend.add_request(2, RequestSpec(prompt, params))
    with caplog.at_level("WARNING", logger="lightllm.structured_output"):
        outputs, statuses = _run(backend)
    assert outputs[1] == alone
    assert statuses[2] == FINISH_GRAMMAR_FAILED and 20 < len(outputs[2]) < 300
    assert "Too many items" in caplog.text
