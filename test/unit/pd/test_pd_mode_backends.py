"""The prefill and decode mode backends, joined by an in-process fake KV transfer.

A prompt prefilled on a prefill backend, its KV copied slot by slot into the slots a decode
backend reserved, and decoded there gives exactly the tokens a normal backend gives; KV is held
on the prefill side until the transfer is acknowledged and reserved on the decode side before
anything moves.  The real transfer (processes, torch.distributed) is the PD issue's; this fake
moves the same bytes between the two nodes' KV caches.
"""

from __future__ import annotations

import json
import time
from typing import Dict, List

import pytest
import torch

from grammar_test_support import run_releasing_grammars, step_releasing_grammars
from lightllm.common.basemodel.batch_generator import BatchGenerator
from lightllm.common.req_manager import ReqManager
from lightllm.common.sampling import SamplingParams
from lightllm.common.sampling.sampler import Sampler
from lightllm.models.registry import load_model
from lightllm.server.core.objs.finish_status import (FINISH_ABORT, FINISH_ERROR, FINISH_HANDED_OFF, FINISH_LENGTH,
                                                    FINISH_SEGMENT_LIMIT, FINISH_STOP)
from lightllm.server.model_rank.kv_cache.infer_context import InferenceContext
from lightllm.server.model_rank.scheduling.infer_req import InferReq
from lightllm.server.model_rank.scheduling.backend_registry import (
    DecodeBackend,
    KvReservationRefused,
    ModeBackend,
    NormalBackend,
    PrefillBackend,
    build_backend,
)
from lightllm.server.model_rank.scheduling.prefill_queue_strategy import build_prefill_queue_strategy
from lightllm.server.model_rank.execution.rank_backend import build_rank_backend
from lightllm.server.model_rank.scheduling.step_planner import StepPlanner
from lightllm.server.model_rank.execution.structured_output import GrammarConstraints
from lightllm.server.http.structured.response_format import response_format_grammar
from lightllm.server.http.structured.structured_params import native_constraint_grammar
from lightllm.utils.tokenizer_utils import load_tokenizer
from lightllm.server.model_rank.scheduling.request_state import InvalidTransition, ReqState
from lightllm.server.core.objs.request_spec import RequestSpec

MAX_LEN = 400


@pytest.fixture(scope="module")
def model(tiny_llama_dir):
    return load_model(str(tiny_llama_dir), dtype=torch.float32)


def _backend(model, run_mode: str, kv_tokens: int = 2048, strategy: str = "hrrn", **mode_settings) -> ModeBackend:
    context = InferenceContext(model.new_kv_cache(kv_tokens), ReqManager(8, MAX_LEN + 1))
    return build_rank_backend(run_mode, model, context, build_prefill_queue_strategy(strategy),
                              StepPlanner(64, 32), Sampler(0), [2], MAX_LEN, **mode_settings)


def _prompts(lengths: List[int], seed: int = 5) -> List[List[int]]:
    gen = torch.Generator().manual_seed(seed)
    return [torch.randint(5, 1000, (n,), generator=gen).tolist() for n in lengths]


def _greedy(max_new: int) -> SamplingParams:
    return SamplingParams(temperature=0, max_new_tokens=max_new, ignore_eos=True)


def fake_transfer(source: InferenceContext, src: InferReq, target: InferenceContext, dst: InferReq) -> None:
    """Copy the prompt KV positions the decode side lacks from the prefill node's slots into the reserved ones."""
    start, end = dst.cur_kv_len, dst.input_len
    src_slots = source.slots(src, start, end).to(source.kv_cache.k_buffer.device)
    dst_slots = target.slots(dst, start, end).to(target.kv_cache.k_buffer.device)
    target.kv_cache.k_buffer[:, dst_slots] = source.kv_cache.k_buffer[:, src_slots]
    target.kv_cache.v_buffer[:, dst_slots] = source.kv_cache.v_buffer[:, src_slots]


def test_build_backend_picks_the_class_of_each_run_mode() -> None:
    assert build_backend("normal") is NormalBackend
    assert build_backend("prefill") is PrefillBackend
    assert build_backend("decode") is DecodeBackend
    assert all(issubclass(cls, ModeBackend) for cls in (NormalBackend, PrefillBackend, DecodeBackend))
    with pytest.raises(ValueError, match="unknown run mode 'pd_master'"):
        build_backend("pd_master")
    with pytest.raises(TypeError, match="abstract"):
        ModeBackend(None, None, None, None, [], 1)  # the hook base names the intake a mode must define


def test_mode_settings_are_constructor_arguments_of_their_mode_only(model) -> None:
    decode = _backend(model, "decode", end_segment_on_kv_pressure=True, max_segment_tokens=4)
    assert decode.end_segment_on_kv_pressure and decode.max_segment_tokens == 4
    assert decode.segment_tokens(10) == 4 and decode.segment_tokens(3) == 3
    assert _backend(model, "decode").segment_tokens(10) == 10  # no segment limit by default
    with pytest.raises(TypeError, match="max_segment_tokens"):
        _backend(model, "normal", max_segment_tokens=4)
    with pytest.raises(TypeError, match="transfer"):
        _backend(model, "normal", transfer=object())
    with pytest.raises(ValueError, match="max_segment_tokens must be >= 0"):
        _backend(model, "decode", max_segment_tokens=-1)


def test_the_normal_intake_joins_unplaced_requests_and_refuses_pd_ones(model, caplog) -> None:
    from lightllm.server.core.objs.io_messages import PdTransferSetup, PdTransferTeardown
    from lightllm.server.core.objs.shm_req_layout import PD_KIND_DECODE, PD_KIND_PREFILL

    normal = _backend(model, "normal")
    req = normal.intake(1, RequestSpec(_prompts([10])[0], _greedy(2)), 3)
    assert normal.requests[1] is req and req.shm_index == 3 and req.state is ReqState.WAITING
    for kind in (PD_KIND_PREFILL, PD_KIND_DECODE):
        with pytest.raises(ValueError, match=f"a normal node cannot run a request of PD kind {kind}"):
            normal.intake(2, RequestSpec.build(_prompts([10])[0], _greedy(2), pd_kind=kind))
    assert list(normal.requests) == [1]
    # No outside work, and a command of another mode is logged as an error and dropped.
    normal.poll()
    assert not normal.has_outside_work
    with caplog.at_level("WARNING", logger="lightllm.model_rank"):
        normal.on_command(PdTransferSetup(3))
        normal.on_command(PdTransferTeardown(3))
    assert "a normal node ignores a PdTransferSetup command" in caplog.text
    assert "a normal node ignores a PdTransferTeardown command" in caplog.text
    # A stray internal message is a bug between the server's own processes: an error, not a warning.
    assert [r.levelname for r in caplog.records if "ignores a" in r.getMessage()] == ["ERROR", "ERROR"]


def test_a_pd_backend_without_a_transfer_takes_no_router_requests(model) -> None:
    from lightllm.server.core.objs.shm_req_layout import PD_KIND_PREFILL

    prefill = _backend(model, "prefill")
    with pytest.raises(RuntimeError, match="without a KV transfer"):
        prefill.intake(1, RequestSpec.build(_prompts([10])[0], _greedy(2), pd_kind=PD_KIND_PREFILL))
    assert not prefill.has_outside_work and not prefill.requests


def test_prefill_then_fake_transfer_then_decode_matches_a_normal_node(model) -> None:
    prompts = _prompts([7, 45, 90, 20])
    max_new = 12
    expected = BatchGenerator(model, 4096).greedy_generate(prompts, max_new)
    prefill = _backend(model, "prefill")
    decode = _backend(model, "decode")
    assert isinstance(prefill, PrefillBackend) and isinstance(decode, DecodeBackend)
    for i, prompt in enumerate(prompts):
        prefill.add_request(i, RequestSpec(prompt, _greedy(max_new)))
    outputs: Dict[int, List[int]] = {}
    handed: Dict[int, InferReq] = {}
    free_before = prefill.kv.allocatable_token_num()
    # Tokens the steps' forwards took in (iteration_tokens_total), per node.
    prefill_forward_tokens = decode_forward_tokens = 0
    while prefill.has_work:
        report = prefill.step()
        prefill_forward_tokens += report.forward_token_num
        assert report.decode_batch_size == 0  # a prefill node never decodes
        for req in report.handoffs:
            assert req.state is ReqState.TRANSFERRING and len(req.output_ids) == 1
            handed[req.request_id] = req
            # Decode reserves first: slots for the prompt exist before a byte moves.
            dst = decode.reserve_prefilled(req.request_id, RequestSpec(list(req.prompt_ids), _greedy(max_new)))
            assert dst.state is ReqState.TRANSFERRING and dst.kv_slot_len == dst.input_len
            # The prefill side still holds the prompt's KV while the transfer is in flight.
            assert prefill.kv.req_manager.slots(req.req_row, 0, req.input_len).numel() == req.input_len
            fake_transfer(prefill.kv, req, decode.kv, dst)
            assert decode.admit_prefilled(dst, req.output_ids[0]) == 0
            prefill.transfer_done(req.request_id, ok=True)
        for req, status in report.finished:
            assert status == FINISH_HANDED_OFF and req.state is ReqState.FINISHED
    assert sorted(handed) == list(range(len(prompts)))
    # Released into the prefix cache: everything is allocatable again.
    assert prefill.kv.allocatable_token_num() == free_before
    while decode.has_work:
        report = decode.step()
        decode_forward_tokens += report.forward_token_num
        for req, status in report.finished:
            assert status == FINISH_LENGTH
            outputs[req.request_id] = list(req.output_ids)
    # The prefill node computed each prompt once; the decode node fed every token but the last,
    # and not the first token's prompt (it came with the KV).
    assert prefill_forward_tokens == sum(len(p) for p in prompts)
    assert decode_forward_tokens == len(prompts) * (max_new - 1)
    assert [outputs[i] for i in range(len(prompts))] == expected


def test_a_constrained_request_through_prefill_and_decode_nodes_matches_a_normal_node(model, tiny_llama_dir) -> None:
    """Both nodes hold the request until its grammar is ready (the decode node compiles from its
    reservation on, while the KV moves); the decode node's matcher continues past the prefill
    node's first token (a fresh one would start the JSON again), so the output is the normal node's."""
    tokenizer = load_tokenizer(str(tiny_llama_dir))
    schema = {"type": "object", "properties": {"flag": {"type": "boolean"}, "pick": {"enum": ["a", "b"]}},
              "required": ["flag", "pick"], "additionalProperties": False}
    grammar = response_format_grammar({"type": "json_schema", "json_schema": {"name": "s", "schema": schema}})
    spec = RequestSpec(tokenizer("Give me JSON")["input_ids"],
                       SamplingParams(temperature=1.0, seed=7, max_new_tokens=40, grammar=grammar))
    normal = _backend(model, "normal", grammar=GrammarConstraints(lambda: tokenizer))
    normal.add_request(1, spec)
    full = run_releasing_grammars(normal)[0][1]
    assert json.loads(tokenizer.decode(full, skip_special_tokens=True))["pick"] in ("a", "b")
    prefill = _backend(model, "prefill", grammar=GrammarConstraints(lambda: tokenizer))
    decode = _backend(model, "decode", grammar=GrammarConstraints(lambda: tokenizer))
    prefill.add_request(1, spec)
    assert prefill.requests[1].grammar_held
    handed: List[InferReq] = []
    while not handed:
        handed = step_releasing_grammars(prefill).handoffs
    dst = decode.reserve_prefilled(1, spec)
    assert dst.grammar_held
    fake_transfer(prefill.kv, handed[0], decode.kv, dst)
    assert decode.admit_prefilled(dst, handed[0].output_ids[0]) == 0
    prefill.transfer_done(1, ok=True)
    assert decode.requests[1].grammar_held and not decode.step().ordered  # admitted, still held
    assert run_releasing_grammars(decode)[0][1] == full


def _handed_off_and_decoded(model, tokenizer, spec: RequestSpec, max_segment_tokens: int) -> tuple:
    """``spec`` as request 1 through a prefill node and a decode node that ends segments after
    ``max_segment_tokens`` tokens: its decode-node output and finish status."""
    prefill = _backend(model, "prefill", grammar=GrammarConstraints(lambda: tokenizer))
    decode = _backend(model, "decode", grammar=GrammarConstraints(lambda: tokenizer),
                      max_segment_tokens=max_segment_tokens)
    prefill.add_request(1, spec)
    handed: List[InferReq] = []
    while not handed:
        report = step_releasing_grammars(prefill)
        assert not report.finished, "the prefill node finished the request instead of handing it off"
        handed = report.handoffs
    dst = decode.reserve_prefilled(1, spec)
    fake_transfer(prefill.kv, handed[0], decode.kv, dst)
    assert decode.admit_prefilled(dst, handed[0].output_ids[0]) == 0
    prefill.transfer_done(1, ok=True)
    outputs, statuses = run_releasing_grammars(decode)
    return outputs[1], statuses[1]


@pytest.mark.parametrize("regex", ["[0-9]{3}", "(yes|no|maybe)"])
def test_a_grammar_completed_on_a_segments_last_token_finishes_the_request(model, tiny_llama_dir, regex) -> None:
    """A normal server finishes a request whose grammar can go no further (``stop``); a decode
    node whose segment limit falls on that same token must finish it too, not end the segment:
    the master would continue it, and the prefill node could only sample an end-of-sequence
    token under the finished grammar (one token more than the normal server's answer)."""
    tokenizer = load_tokenizer(str(tiny_llama_dir))
    grammar = native_constraint_grammar({"regular_constraint": regex})
    spec = RequestSpec(tokenizer("x=")["input_ids"], SamplingParams(temperature=0, max_new_tokens=10, grammar=grammar))
    normal = _backend(model, "normal", grammar=GrammarConstraints(lambda: tokenizer))
    normal.add_request(1, spec)
    outputs, statuses = run_releasing_grammars(normal)
    full, status = outputs[1], statuses[1]
    assert status == FINISH_STOP and 2 <= len(full) < 10, (full, status)  # the grammar ended it on the decode node
    assert _handed_off_and_decoded(model, tokenizer, spec, max_segment_tokens=len(full)) == (full, FINISH_STOP)
    # A limit before the grammar's end still ends the segment there, unfinished.
    assert _handed_off_and_decoded(model, tokenizer, spec, max_segment_tokens=len(full) - 1) == (
        full[:-1], FINISH_SEGMENT_LIMIT)


def test_a_grammar_completed_by_the_prefill_nodes_first_token_finishes_there(model, tiny_llama_dir) -> None:
    """A grammar the prefill node's first token completes ends the request on the prefill node
    (``stop``, no hand-off), as a normal server ends it after that token."""
    tokenizer = load_tokenizer(str(tiny_llama_dir))
    grammar = native_constraint_grammar({"regular_constraint": "[0-9]"})
    spec = RequestSpec(tokenizer("x=")["input_ids"], SamplingParams(temperature=0, max_new_tokens=10, grammar=grammar))
    normal = _backend(model, "normal", grammar=GrammarConstraints(lambda: tokenizer))
    normal.add_request(1, spec)
    expected = run_releasing_grammars(normal)
    prefill = _backend(model, "prefill", grammar=GrammarConstraints(lambda: tokenizer))
    prefill.add_request(1, spec)
    outputs, statuses = run_releasing_grammars(prefill)
    assert (outputs, statuses) == expected and statuses == {1: FINISH_STOP} and len(outputs[1]) == 1


def test_a_decode_node_ends_a_request_whose_compile_raised_only_once_its_kv_arrived(model, tiny_llama_dir) -> None:
    """A compile raising on rank 0 ends the request with FINISH_ERROR on every rank, but a decode node's
    request waits for its KV first: ended at once, it would free KV a transfer still writes into."""
    tokenizer = load_tokenizer(str(tiny_llama_dir))

    def unreadable() -> None:
        raise OSError("tokenizer.json went away")

    grammar = response_format_grammar({"type": "json_schema",
                                       "json_schema": {"name": "s", "schema": {"type": "boolean"}}})
    spec = RequestSpec(tokenizer("Give me JSON")["input_ids"], SamplingParams(max_new_tokens=8, grammar=grammar))
    constraints = GrammarConstraints(unreadable)
    decode = _backend(model, "decode", grammar=constraints)
    dst = decode.reserve_prefilled(1, spec)
    deadline = time.monotonic() + 60
    while constraints.compiled([1]) != ([], [1]):  # the compile raised on this rank 0
        assert time.monotonic() < deadline, "the compile never ended"
        time.sleep(0.01)
    assert decode.grammars_compiled() == ([], []) and not decode.step().finished  # its KV is still moving
    assert decode.admit_prefilled(dst, tokenizer.convert_tokens_to_ids("true")) == 0
    assert decode.grammars_compiled() == ([], [1])
    decode.grammars_ready(*decode.grammars_compiled())
    assert [(req.request_id, status) for req, status in decode.step().finished] == [(1, FINISH_ERROR)]
    assert not decode.has_work


def test_decode_reservation_is_refused_at_once_when_kv_is_short(model) -> None:
    decode = _backend(model, "decode", kv_tokens=100)
    ok = decode.reserve_prefilled(1, RequestSpec(_prompts([40])[0], _greedy(20)))
    assert decode.kv.allocatable_token_num() == 60
    # 60 allocatable, of which request 1 was promised 20 for its decode tokens.
    with pytest.raises(KvReservationRefused, match=r"needs 80 KV tokens .*, 40 allocatable and not promised"):
        decode.reserve_prefilled(2, RequestSpec(_prompts([50])[0], _greedy(30)))
    assert list(decode.requests) == [1]  # the refused request left no trace
    decode.transfer_failed(ok)
    report = decode.step()
    assert [(r.request_id, s) for r, s in report.finished] == [(1, FINISH_ERROR)]
    assert decode.kv.allocatable_token_num() == 100 and not decode.has_work


def test_abort_during_transfer_waits_for_the_transfer_to_end(model) -> None:
    """A transfer that succeeds is a hand-off even when an abort came meanwhile (the master
    closes P's stream once D confirmed the KV, which may overtake P's own report); one that
    fails after an abort is the abort."""
    prefill = _backend(model, "prefill")
    prefill.add_request(3, RequestSpec(_prompts([30])[0], _greedy(8)))
    report = prefill.step()
    assert [r.request_id for r in report.handoffs] == [3]
    prefill.abort(3)
    assert prefill.step().finished == []  # its KV is still being read
    assert prefill.requests[3].state is ReqState.TRANSFERRING
    prefill.transfer_done(3, ok=True)
    assert [(r.request_id, s) for r, s in prefill.step().finished] == [(3, FINISH_HANDED_OFF)]
    with pytest.raises(ValueError, match="no transfer in flight"):
        prefill.transfer_done(3, ok=True)
    prefill.add_request(5, RequestSpec(_prompts([30])[0], _greedy(8)))
    prefill.step()
    prefill.abort(5)
    prefill.transfer_done(5, ok=False)  # given up (cancelled) because of the abort
    assert [(r.request_id, s) for r, s in prefill.step().finished] == [(5, FINISH_ABORT)]


def test_a_failed_transfer_fails_the_request_and_frees_its_kv(model) -> None:
    prefill = _backend(model, "prefill")
    free = prefill.kv.kv_cache.available
    prefill.add_request(4, RequestSpec(_prompts([30])[0], _greedy(8)))
    prefill.step()
    assert prefill.kv.kv_cache.available < free
    prefill.transfer_done(4, ok=False)
    assert [(r.request_id, s) for r, s in prefill.step().finished] == [(4, FINISH_ERROR)]
    assert prefill.kv.allocatable_token_num() == free


def test_a_request_walks_the_lifecycle_and_illegal_moves_raise(model) -> None:
    backend = _backend(model, "normal", strategy="default")
    req = backend.add_request(9, RequestSpec(_prompts([70])[0], _greedy(3)))
    seen = [req.state]
    while backend.has_work:
        backend.step()
        if req.state is not seen[-1]:
            seen.append(req.state)
    assert seen == [ReqState.WAITING, ReqState.PREFILLING, ReqState.DECODING, ReqState.FINISHED]
    with pytest.raises(InvalidTransition, match="request 9 cannot go from finished to decoding"):
        req.move_to(ReqState.DECODING)
    fresh = InferReq(10, [1, 2, 3])
    with pytest.raises(InvalidTransition, match="from waiting to waiting"):
        fresh.move_to(ReqState.WAITING)
    fresh.move_to(ReqState.PREFILLING)
    fresh.move_to(ReqState.PAUSED)
    with pytest.raises(InvalidTransition, match="from paused to decoding"):
        fresh.move_to(ReqState.DECODING)


def test_the_step_engine_imports_without_torch() -> None:
    import subprocess
    import sys

    code = (
        "import sys\n"
        "import lightllm.server.model_rank.scheduling.step_engine\n"
        "import lightllm.server.model_rank.scheduling.backend_registry\n"
        "import lightllm.server.model_rank.scheduling.kv_view\n"
        "assert 'torch' not in sys.modules, 'the scheduling core imported torch'\n"
    )
    subprocess.run([sys.executable, "-c", code], check=True)
