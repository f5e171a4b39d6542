"""RequestSpec: one request, checked once where it is built, carried whole to the ranks.

Each group refuses its own bad values (and the spec the rules that span groups) with a
``RequestSpecError`` naming the field; a spec survives the shared-memory record unchanged; and
model rank 0's screen, which rebuilds the spec from the record, refuses a damaged record alone.
"""

from __future__ import annotations

import dataclasses
import uuid
from typing import Any, Callable

import pytest

from lightllm.common.sampling import SamplingParamError, SamplingParams
from lightllm.server.core.objs.io_messages import AddRequests
from lightllm.server.core.objs.request_spec import PdPlacement, Priority, RequestSpec, RequestSpecError, Segment
from lightllm.server.core.objs.shm_req_buffer import ShmReqBuffer
from lightllm.server.core.objs.shm_req_layout import PD_KIND_DECODE, PD_KIND_NONE, PD_KIND_PREFILL, wants_top_rows
from lightllm.server.model_rank.scheduling.admission import RequestRejected, check_request
from lightllm.server.model_rank.scheduling.infer_req import InferReq
from lightllm.server.router.req_queue.normal_queue import RouterReq

VOCAB = 100
MAX_LEN = 32


def _params(**fields: Any) -> SamplingParams:
    return SamplingParams(**{"max_new_tokens": 4, **fields})


def _full_spec() -> RequestSpec:
    """Every field away from its default, in values each stored width holds exactly."""
    params = _params(temperature=0.5, top_p=0.75, top_k=7, seed=11, min_new_tokens=1, stop_token_ids=[3, 4],
                     logprobs=2, prompt_logprobs=1, stop_sequences=["END", "\u00e9t\u00e9"], ignore_eos=True,
                     do_sample=True, presence_penalty=0.25, logit_bias={5: -1.5, 9: 2.0},
                     exponential_decay_start=2, exponential_decay_factor=1.5, grammar='{"type": "object"}')
    return RequestSpec(
        (5, 6, 7, 8), params,
        Priority(high_priority_request=True, infer_high_priority=-3),
        Segment(segment_index=2, generated_before=2),
        PdPlacement(kind=PD_KIND_PREFILL, kv_start=1),
    )


@pytest.mark.parametrize(
    ("build", "field"),
    [
        (lambda: RequestSpec([], _params()), "prompt_ids"),
        (lambda: RequestSpec([1, 2.0], _params()), "prompt_ids"),
        (lambda: RequestSpec(["1"], _params()), "prompt_ids"),
        (lambda: RequestSpec("hello", _params()), "prompt_ids"),
        (lambda: RequestSpec([3, -1], _params()), "prompt_ids"),
        (lambda: RequestSpec([1], {"max_new_tokens": 4}), "params"),
        (lambda: RequestSpec([1], _params(), priority="high"), "priority"),
        (lambda: Priority(high_priority_request=1), "high_priority_request"),
        (lambda: Priority(infer_high_priority=2**31), "infer_high_priority"),
        (lambda: Priority(infer_high_priority=-(2**31) - 1), "infer_high_priority"),
        (lambda: Priority(infer_high_priority=1.5), "infer_high_priority"),
        (lambda: Priority(infer_high_priority=True), "infer_high_priority"),
        (lambda: Segment(segment_index=-1), "segment_index"),
        (lambda: Segment(segment_index=True), "segment_index"),
        (lambda: Segment(segment_index=2**31), "segment_index"),
        (lambda: Segment(segment_index=1, generated_before=-1), "generated_before"),
        (lambda: Segment(segment_index=1, generated_before=1.0), "generated_before"),
        (lambda: Segment(segment_index=0, generated_before=1), "generated_before"),  # only continuations
        (lambda: PdPlacement(kind=3), "pd_kind"),
        (lambda: PdPlacement(kind=True), "pd_kind"),
        (lambda: PdPlacement(kind=PD_KIND_PREFILL, kv_start=-1), "kv_start"),
        (lambda: PdPlacement(kind=PD_KIND_DECODE, kv_start=1), "kv_start"),  # the decode node picks it
        (lambda: PdPlacement(kind=PD_KIND_NONE, kv_start=1), "kv_start"),
        # Rules spanning the prompt and a group, or two groups.
        (lambda: RequestSpec.build([1, 2], _params(), segment_index=1, generated_before=2), "generated_before"),
        (lambda: RequestSpec.build([1, 2], _params(), pd_kind=PD_KIND_PREFILL, kv_start=2), "kv_start"),
        (lambda: RequestSpec.build([1, 2], _params(), infer_high_priority=-1), "infer_high_priority"),
    ],
)
def test_each_invariant_is_refused_naming_its_field(build: Callable[[], Any], field: str) -> None:
    with pytest.raises(RequestSpecError) as info:
        build()
    assert info.value.field == field
    assert field in str(info.value), str(info.value)
    assert isinstance(info.value, ValueError)  # the managers' callers turn ValueError into a 400


def test_the_edges_of_each_range_are_accepted() -> None:
    spec = RequestSpec.build([0, 5], _params(), infer_high_priority=-(2**31), segment_index=2**31 - 1,
                             generated_before=1, pd_kind=PD_KIND_PREFILL, kv_start=1)
    assert (spec.prompt_len, spec.segment.generated_before, spec.pd.kv_start) == (2, 1, 1)
    assert RequestSpec([7], _params()).priority == Priority() and RequestSpec([7], _params()).pd == PdPlacement()


def test_a_spec_is_frozen_and_owns_its_prompt() -> None:
    prompt = [5, 6, 7]
    spec = RequestSpec(prompt, _params())
    prompt.append(8)
    assert spec.prompt_ids == (5, 6, 7)
    with pytest.raises(dataclasses.FrozenInstanceError):
        spec.prompt_ids = (1,)  # type: ignore[misc]
    with pytest.raises(dataclasses.FrozenInstanceError):
        spec.segment.segment_index = 3  # type: ignore[misc]


def test_check_fits_holds_the_model_dependent_checks() -> None:
    RequestSpec([VOCAB - 1], _params(max_new_tokens=MAX_LEN - 1)).check_fits(VOCAB, MAX_LEN)
    with pytest.raises(RequestSpecError, match="prompt_ids") as info:
        RequestSpec([1, VOCAB], _params()).check_fits(VOCAB, MAX_LEN)
    assert info.value.field == "prompt_ids"
    with pytest.raises(RequestSpecError, match="max_new_tokens .* exceeds max_req_total_len") as info:
        RequestSpec([1, 2], _params(max_new_tokens=MAX_LEN - 1)).check_fits(VOCAB, MAX_LEN)
    assert info.value.field == "max_new_tokens"
    with pytest.raises(SamplingParamError, match="stop_token_ids"):
        RequestSpec([1], _params(stop_token_ids=[VOCAB])).check_fits(VOCAB, MAX_LEN)


def test_the_router_and_the_rank_views_read_the_spec() -> None:
    spec = _full_spec()
    router = RouterReq.from_spec(9, 3, spec)
    # A prefill node's request reserves KV for its first token only (later ones live on the decode node).
    assert (router.request_id, router.shm_index, router.input_len, router.max_new_tokens,
            router.high_priority_request) == (9, 3, 4, 1, True)
    normal = RouterReq.from_spec(9, 3, dataclasses.replace(spec, pd=PdPlacement()))
    assert (normal.max_new_tokens, normal.projected_token_num) == (4, 8)
    req = InferReq.from_spec(9, spec, shm_index=3, arrival_processed_prefill_tokens=40)
    assert (req.prompt_ids, req.max_new_tokens, req.infer_high_priority, req.generated_before) == (
        [5, 6, 7, 8], 4, -3, 2)
    assert (req.shm_index, req.arrival_processed_prefill_tokens, req.sampling) == (3, 40, spec.params)
    # Fields nobody on the rank read are gone from its request.
    assert not {"segment_index", "high_priority_request"} & {f.name for f in dataclasses.fields(InferReq)}
    assert not {"segment_index", "infer_high_priority"} & {f.name for f in dataclasses.fields(RouterReq)}


@pytest.fixture()
def shm():
    name = f"lightllm_test_{uuid.uuid4().hex[:12]}"
    owner = ShmReqBuffer(name, 4, MAX_LEN, create=True, top_slot_num=1)
    other = ShmReqBuffer(name, 4, MAX_LEN, create=False, top_slot_num=1)  # another process's mapping
    yield owner, other
    other.close()
    owner.close()
    owner.unlink()


@pytest.mark.parametrize("spec", [_full_spec(), RequestSpec([1], _params()),
                                  RequestSpec.build([1, 2, 3], _params(do_sample=False), pd_kind=PD_KIND_DECODE)])
def test_a_spec_round_trips_through_shared_memory_unchanged(shm, spec: RequestSpec) -> None:
    owner, other = shm
    owner.write_request(2, 10**12 + 5, spec, 0 if wants_top_rows(spec.params) else None)
    back = other.read_request(2, 10**12 + 5)
    assert back == spec
    assert back.params.to_dict() == spec.params.to_dict()


class _RankLimits:
    """The part of a backend rank 0's screen calls: this rank's limits."""

    def check_request(self, spec: Any) -> None:
        check_request(spec, vocab_size=VOCAB, max_req_total_len=MAX_LEN, grammar_enabled=False)


def _damage(rec: Any, name: str, value: Any) -> None:
    rec[name] = value


@pytest.mark.parametrize(
    ("damage", "why"),
    [
        (lambda rec: _damage(rec, "generated_before", 3), "generated_before"),  # no prompt token left
        (lambda rec: _damage(rec, "pd_kind", 7), "pd_kind"),
        (lambda rec: _damage(rec, "infer_high_priority", -1), "infer_high_priority"),  # a promoted first segment
        (lambda rec: _damage(rec, "kv_start", 1), "kv_start"),  # kv_start without a prefill kind
        (lambda rec: _damage(rec, "segment_index", -4), "segment_index"),
        (lambda rec: rec["prompt_ids"].__setitem__(1, VOCAB + 5), "prompt_ids"),  # the rank's vocabulary
        (lambda rec: _damage(rec, "top_p", 0.0), "top_p"),
        (lambda rec: _damage(rec, "max_new_tokens", MAX_LEN), "max_req_total_len"),
        (lambda rec: _damage(rec, "stop_sequences_json", b"[not json"), "Expecting value"),
    ],
)
def test_rank0_screen_refuses_a_corrupted_record_alone(shm, caplog, damage: Callable[[Any], None], why: str) -> None:
    # Imported here: the rank process module loads torch, which the rest of this file does not need.
    from lightllm.server.model_rank.rank_process import ModelRank, RejectRequests

    owner, _ = shm
    for slot in range(3):
        owner.write_request(slot, 100 + slot, RequestSpec([5, 6, 7], _params()))
    damage(owner.array[1])  # after the HTTP side built and wrote a valid spec
    rank = ModelRank(_RankLimits(), owner, is_leader=True)  # rank 0's screen only: no process, no model, no sockets
    with caplog.at_level("WARNING", logger="lightllm.model_rank"):
        commands = rank.screen([AddRequests([(100, 0), (101, 1), (102, 2)])])
    assert [type(c) for c in commands] == [AddRequests, RejectRequests]
    assert commands[0].requests == [(100, 0), (102, 2)] and commands[1] == RejectRequests([(101, 1)])
    assert set(rank._screened) == {100, 102}  # the specs read here are the ones every rank admits
    assert why in caplog.text, caplog.text


def test_the_screen_limits_are_the_ranks() -> None:
    spec = RequestSpec([5], _params(grammar='{"type": "object"}'))
    with pytest.raises(RequestRejected, match="structured output"):
        check_request(spec, vocab_size=VOCAB, max_req_total_len=MAX_LEN, grammar_enabled=False)
    check_request(spec, vocab_size=VOCAB, max_req_total_len=MAX_LEN, grammar_enabled=True)
    with pytest.raises(RequestRejected, match="RequestSpec"):
        check_request(([5], _params()), vocab_size=VOCAB, max_req_total_len=MAX_LEN, grammar_enabled=True)


def test_a_pd_node_passes_the_wire_spec_whole_to_generate() -> None:
    import asyncio
    import types

    from lightllm.server.pd.node.service import PdNodeService

    calls: list = []

    async def generate(spec: RequestSpec, **kwargs: Any):
        calls.append((spec, kwargs))
        return
        yield  # an async generator that ends at once

    async def wait_request_id_free(request_id: int, timeout: float) -> bool:
        return True

    manager = types.SimpleNamespace(generate=generate, wait_request_id_free=wait_request_id_free,
                                    add_inbox_handler=lambda types_, handler: None)
    service = PdNodeService(manager, "decode", 1.0, "ipc:///nowhere")
    service.epochs[4] = None

    async def run(spec: RequestSpec) -> list:
        return [event async for event in service.generate(spec, request_id=12, epoch=4)]

    decode = RequestSpec.build([1, 2, 3], _params(), segment_index=1, generated_before=1, pd_kind=PD_KIND_DECODE)
    assert asyncio.run(run(decode)) == []
    # The request runs under the epoch of its pair (spec.pd.epoch), the rest of the spec as sent;
    # a continuation segment (segment_index 1) starts even while the node drains.
    assert calls == [(dataclasses.replace(decode, pd=dataclasses.replace(decode.pd, epoch=4)),
                      {"request": None, "request_id": 12, "slot_wait_seconds": 0.0, "drain_exempt": True})]
    # A spec of another kind (a prefill request, with its kv_start) never reaches a decode node's manager.
    with pytest.raises(ValueError, match="PD kind"):
        asyncio.run(run(RequestSpec.build([1, 2, 3], _params(), pd_kind=PD_KIND_PREFILL, kv_start=1)))
    assert len(calls) == 1
