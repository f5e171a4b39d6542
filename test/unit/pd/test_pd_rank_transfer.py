"""A PD node rank's transfer plumbing (its PdRankTransfer side) over real backends and real transfer processes.

Two ranks in one process, the way a prefill node's rank and a decode node's rank run them: each
backend carries its side's PdRankTransfer and the test drives only the backend's hooks, as the rank loop does
(``intake``, ``poll``, ``step``, ``on_command``; the ranks are ``pd_rank_node_support.py``'s nodes):
transfer setup per epoch (several pairs on one prefill rank, and their teardown), the decode side
reserving first (or answering busy), the prefill side sending [kv_start, prompt_len) with its first token in the header after the step that handed the
request off, and each side acting on polled results.  Greedy outputs must equal a normal node's,
a second request with the same prompt must only move what the decode node's prefix cache lacks,
and every failure (lease expiry, no setup) must end its request with FINISH_TRANSFER_FAILED and
give the KV back.
"""

from __future__ import annotations

from typing import Dict

import pytest
import torch

from lightllm.common.basemodel.batch_generator import BatchGenerator
from lightllm.common.sampling import SamplingParams
from lightllm.models.registry import load_model
from lightllm.server.core.objs.finish_status import (
    FINISH_ABORT,
    FINISH_BUSY,
    FINISH_HANDED_OFF,
    FINISH_LENGTH,
    FINISH_SEGMENT_KV,
    FINISH_SEGMENT_LIMIT,
    FINISH_TRANSFER_FAILED,
)
from lightllm.server.core.objs.io_messages import PdChannelBroken, PdNotice, PdTransferSetup, PdTransferTeardown
from lightllm.server.core.objs.shm_req_layout import PD_KIND_DECODE, PD_KIND_NONE, PD_KIND_PREFILL
from lightllm.server.model_rank.scheduling.backend_registry import KvReservationRefused
from lightllm.server.model_rank.rank_config import PdRankSettings
from lightllm.server.core.objs.request_spec import RequestSpec

from pd_rank_node_support import Node, backend_for, run_until, set_up_pair, submit


@pytest.fixture(scope="module")
def model(tiny_llama_dir):
    return load_model(str(tiny_llama_dir), dtype=torch.float32)


@pytest.fixture(scope="module")
def pair(model):
    settings = dict(page_size=16, transfer_timeout_s=20.0, connect_timeout_s=60.0)
    prefill = Node(model, "prefill", PdRankSettings(**settings))
    decode = Node(model, "decode", PdRankSettings(**settings, reserve_lease_s=30.0))
    set_up_pair(prefill, decode, epoch=1)
    yield prefill, decode
    prefill.pd.close()
    decode.pd.close()


def test_greedy_outputs_through_the_rank_plumbing_equal_a_normal_node(model, pair) -> None:
    prefill, decode = pair
    p_free, d_free = prefill.backend.kv.allocatable_token_num(), decode.backend.kv.allocatable_token_num()
    gen = torch.Generator().manual_seed(3)
    prompts = [torch.randint(5, 1000, (n,), generator=gen).tolist() for n in (7, 40, 90)]
    prompts.append(list(prompts[1]))  # again: D's prefix cache holds most of it by then
    max_new = 9
    expected = BatchGenerator(model, 4096).greedy_generate(prompts, max_new)
    params = SamplingParams(temperature=0, max_new_tokens=max_new, ignore_eos=True)
    kv_starts = {}
    for rid in range(3):
        kv_starts[rid] = submit(prefill, decode, rid, prompts[rid], params)
    run_until((prefill, decode), lambda: all(r in decode.finished for r in range(3)))
    kv_starts[3] = submit(prefill, decode, 3, prompts[3], params)
    run_until((prefill, decode), lambda: 3 in decode.finished and 3 in prefill.finished)
    assert [kv_starts[r] for r in range(3)] == [0, 0, 0]
    assert kv_starts[3] == len(prompts[3]) - 1  # only the last prompt position moved
    for rid in range(4):
        # D published P's first token (from the transfer header), then its own tokens.
        assert decode.tokens[rid] == expected[rid], rid
        assert prefill.tokens[rid] == expected[rid][:1]
        assert prefill.finished[rid] == FINISH_HANDED_OFF and decode.finished[rid] == FINISH_LENGTH
        sent, received = prefill.notices(rid)["transferred"], decode.notices(rid)["transferred"]
        assert sent.nbytes == received.nbytes == (len(prompts[rid]) - kv_starts[rid]) * prefill.backend.kv.kv_cache.token_bytes()
    run_until((prefill, decode), lambda: not prefill.backend.has_work and not decode.backend.has_work)
    assert prefill.backend.kv.allocatable_token_num() == p_free
    assert decode.backend.kv.allocatable_token_num() == d_free


def test_one_prefill_rank_serves_two_decode_nodes_and_a_teardown_drops_only_its_pair(model) -> None:
    """Two pairs (epochs) on one prefill rank and port: requests interleave, each on its own pair."""
    settings = dict(page_size=16, transfer_timeout_s=20.0, connect_timeout_s=60.0)
    prefill = Node(model, "prefill", PdRankSettings(**settings))
    decodes = {21: Node(model, "decode", PdRankSettings(**settings, reserve_lease_s=30.0)),
               22: Node(model, "decode", PdRankSettings(**settings, reserve_lease_s=30.0))}
    nodes = (prefill, *decodes.values())
    try:
        for epoch, decode in decodes.items():
            set_up_pair(prefill, decode, epoch)
        assert prefill.pd.epochs == [21, 22]
        ports = {prefill.pd.handle_for(e).store_port for e in decodes}
        assert ports == {prefill.pd.store_host.port}
        gen = torch.Generator().manual_seed(8)
        prompts = [torch.randint(5, 1000, (n,), generator=gen).tolist() for n in (12, 50, 33, 71)]
        max_new = 6
        expected = BatchGenerator(model, 4096).greedy_generate(prompts, max_new)
        params = SamplingParams(temperature=0, max_new_tokens=max_new, ignore_eos=True)
        epoch_of = {rid: 21 + rid % 2 for rid in range(len(prompts))}  # interleaved between the peers
        for rid, prompt in enumerate(prompts):
            assert submit(prefill, decodes[epoch_of[rid]], rid, prompt, params, epoch=epoch_of[rid]) == 0
        run_until(nodes, lambda: all(rid in decodes[e].finished and rid in prefill.finished for rid, e in epoch_of.items()))
        token_bytes = prefill.backend.kv.kv_cache.token_bytes()
        for rid, epoch in epoch_of.items():
            decode, other = decodes[epoch], decodes[43 - epoch]
            assert decode.tokens[rid] == expected[rid] and rid not in other.tokens, rid
            assert prefill.finished[rid] == FINISH_HANDED_OFF and decode.finished[rid] == FINISH_LENGTH
            assert decode.notices(rid)["transferred"].nbytes == len(prompts[rid]) * token_bytes

        # The master drops epoch 21 on the prefill node (its decode node left): requests of
        # epoch 21 fail as a broken transfer, epoch 22 keeps working on the same port.
        assert decodes[21].backend.intake(10, RequestSpec.build(prompts[0], params, pd_kind=PD_KIND_DECODE,
                                                                 pd_epoch=21)) is not None
        prefill.backend.on_command(PdTransferTeardown(21))
        assert prefill.pd.epochs == [22]
        run_until(nodes, lambda: 10 in decodes[21].finished)
        assert decodes[21].finished[10] == FINISH_TRANSFER_FAILED
        assert decodes[21].notices(10)["transfer_failed"].error_kind == "transfer_broken"
        # The decode node learnt it from the pair's closing announcement and reports that pair only.
        assert [m.epoch for m in decodes[21].messages if isinstance(m, PdChannelBroken)] == [21]
        prefill.backend.intake(11, RequestSpec.build(prompts[1], params, pd_kind=PD_KIND_PREFILL, pd_epoch=21))
        assert submit(prefill, decodes[22], 12, prompts[2], params, epoch=22) is not None
        run_until(nodes, lambda: 11 in prefill.finished and 12 in decodes[22].finished and 12 in prefill.finished)
        assert prefill.finished[11] == FINISH_TRANSFER_FAILED
        assert prefill.notices(11)["transfer_failed"].error_kind == "transfer_broken"
        assert "epoch 21 is not set up" in prefill.notices(11)["transfer_failed"].message
        assert decodes[22].tokens[12] == expected[2] and prefill.finished[12] == FINISH_HANDED_OFF
        assert not any(isinstance(m, PdChannelBroken) for m in prefill.messages + decodes[22].messages)
        # Tearing down an epoch nobody holds is a no-op.
        assert prefill.pd.teardown(21) is False and prefill.pd.teardown(99) is False
    finally:
        for node in nodes:
            node.pd.close()


def test_segment_limit_ends_the_segment_after_its_tokens(model) -> None:
    settings = dict(page_size=16, transfer_timeout_s=20.0, connect_timeout_s=60.0)
    prefill = Node(model, "prefill", PdRankSettings(**settings), kv_tokens=512)
    decode = Node(model, "decode", PdRankSettings(**settings, reserve_lease_s=30.0), kv_tokens=512,
                  max_segment_tokens=4)
    set_up_pair(prefill, decode, epoch=2)
    try:
        prompt = list(range(10, 40))
        expected = BatchGenerator(model, 4096).greedy_generate([prompt], 10)[0]
        submit(prefill, decode, 20, prompt, SamplingParams(temperature=0, max_new_tokens=10, ignore_eos=True))
        run_until((prefill, decode), lambda: 20 in decode.finished)
        assert decode.finished[20] == FINISH_SEGMENT_LIMIT
        assert decode.tokens[20] == expected[:4]
        # The reservation was for the segment's 4 tokens, not for max_new_tokens' 10.
        assert decode.backend.segment_tokens(10) == 4
    finally:
        prefill.pd.close()
        decode.pd.close()


def test_a_lease_that_expires_fails_the_request_and_frees_its_kv(model) -> None:
    decode = Node(model, "decode", PdRankSettings(reserve_lease_s=0.5), kv_tokens=256)
    prefill = Node(model, "prefill", PdRankSettings(), kv_tokens=512)
    set_up_pair(prefill, decode, epoch=7)
    try:
        free = decode.backend.kv.allocatable_token_num()
        params = SamplingParams(temperature=0, max_new_tokens=8, ignore_eos=True)
        assert decode.backend.intake(1, RequestSpec.build(list(range(5, 45)), params, pd_kind=PD_KIND_DECODE,
                                                          pd_epoch=7)) is not None
        assert decode.backend.kv.allocatable_token_num() < free
        # More than the cache can hold now: busy at once, reported by the next step.
        busy = RequestSpec.build(list(range(5, 45)), SamplingParams(max_new_tokens=300), pd_kind=PD_KIND_DECODE)
        assert decode.backend.intake(2, busy) is None
        decode.iterate()
        assert decode.finished[2] == FINISH_BUSY
        run_until((decode,), lambda: 1 in decode.finished, timeout_s=30)  # P never sends
        assert decode.finished[1] == FINISH_TRANSFER_FAILED
        assert decode.notices(1)["transfer_failed"].error_kind == "lease_expired"
        assert decode.backend.kv.allocatable_token_num() == free
    finally:
        prefill.pd.close()
        decode.pd.close()


def test_an_aborted_reservation_gives_its_kv_back_without_waiting_for_the_lease(model, caplog) -> None:
    """The master closes D's stream when P's first token already ended the request: no KV comes,
    and the reservation must not hold its KV until the lease runs out.  The node logs the cancel
    once, naming the request once (it read "request 3: request 3: receive cancelled ...")."""
    decode = Node(model, "decode", PdRankSettings(reserve_lease_s=300.0), kv_tokens=256)
    prefill = Node(model, "prefill", PdRankSettings(), kv_tokens=512)
    set_up_pair(prefill, decode, epoch=8)
    try:
        free = decode.backend.kv.allocatable_token_num()
        params = SamplingParams(temperature=0, max_new_tokens=1, ignore_eos=True)
        assert decode.backend.intake(3, RequestSpec.build(list(range(5, 45)), params, pd_kind=PD_KIND_DECODE,
                                                          pd_epoch=8)) is not None
        assert decode.backend.kv.allocatable_token_num() < free
        with caplog.at_level("INFO", logger="lightllm.pd_rank"):
            decode.backend.abort(3)
            run_until((decode,), lambda: 3 in decode.finished, timeout_s=30)  # well before the 300 s lease
        assert decode.finished[3] == FINISH_ABORT
        cancels = [r.getMessage() for r in caplog.records if "cancelled" in r.getMessage()]
        assert len(cancels) == 1 and cancels[0].startswith("request 3: receive cancelled"), cancels
        assert decode.backend.kv.allocatable_token_num() == free
        # The pair still works: a later request's KV moves as usual.
        prompt = list(range(10, 40))
        expected = BatchGenerator(model, 4096).greedy_generate([prompt], 3)[0]
        submit(prefill, decode, 4, prompt, SamplingParams(temperature=0, max_new_tokens=3, ignore_eos=True))
        run_until((prefill, decode), lambda: 4 in decode.finished)
        assert decode.tokens[4] == expected
    finally:
        prefill.pd.close()
        decode.pd.close()


def test_without_a_setup_a_handoff_fails_as_transfer_broken(model) -> None:
    prefill = Node(model, "prefill", PdRankSettings(), kv_tokens=512)
    free = prefill.backend.kv.allocatable_token_num()
    prefill.backend.intake(5, RequestSpec.build(list(range(5, 30)), SamplingParams(temperature=0, max_new_tokens=4,
                                                                                   ignore_eos=True),
                                                pd_kind=PD_KIND_PREFILL))
    run_until((prefill,), lambda: 5 in prefill.finished, timeout_s=30)
    assert prefill.tokens[5] and prefill.finished[5] == FINISH_TRANSFER_FAILED
    assert prefill.notices(5)["transfer_failed"].error_kind == "transfer_broken"
    assert prefill.backend.kv.allocatable_token_num() == free


def test_a_refused_setup_is_answered_with_its_attempts_id(model) -> None:
    """The node's HTTP process matches rank 0's answer to its attempt by this id (a refusal too)."""
    decode = Node(model, "decode", PdRankSettings(), kv_tokens=256)
    decode.backend.on_command(PdTransferSetup(4, "", 0, setup_id=17))
    answer = decode.messages[-1]
    assert (answer.epoch, answer.setup_id) == (4, 17)
    assert "a decode node needs the prefill transfer address" in answer.error
    assert decode.pd.handle_for(4) is None


@pytest.mark.parametrize(("role", "kind"), [("prefill", PD_KIND_NONE), ("prefill", PD_KIND_DECODE),
                                            ("decode", PD_KIND_NONE), ("decode", PD_KIND_PREFILL)])
def test_a_node_takes_requests_of_its_own_pd_kind_only(model, role: str, kind: int) -> None:
    node = Node(model, role, PdRankSettings(), kv_tokens=256)
    spec = RequestSpec.build(list(range(5, 15)), SamplingParams(max_new_tokens=4), pd_kind=kind)
    with pytest.raises(ValueError, match=f"a {role} node cannot run a request of PD kind {kind}"):
        node.backend.intake(1, spec)
    assert not node.backend.requests and not node.messages and not node.pd.in_flight


def test_the_decode_nodes_first_token_leads_the_next_steps_tokens(model) -> None:
    """The token from the transfer header is reported by the engine, ahead of the step's own."""
    decode = backend_for(model, "decode", kv_tokens=256)
    params = SamplingParams(temperature=0, max_new_tokens=5, ignore_eos=True)
    req = decode.reserve_prefilled(1, RequestSpec(list(range(10, 20)), params))
    assert decode.admit_prefilled(req, 77) == 0
    report = decode.step()
    assert report.carried_tokens == 1
    assert [(r.request_id, t) for r, t, _ in report.tokens][:2] == [(1, 77), (1, req.output_ids[1])]
    assert decode.step().carried_tokens == 0


def test_decode_backend_ends_the_segment_under_kv_pressure_instead_of_pausing(model) -> None:
    decode = backend_for(model, "decode", kv_tokens=64, prefix_cache=False)
    params = SamplingParams(temperature=0, max_new_tokens=40, ignore_eos=True)
    # Each is promised 5 decode tokens but may take 40: the cache (64) is over-committed.
    reqs = [decode.reserve_prefilled(rid, RequestSpec(list(range(10 + rid, 20 + rid)), params), decode_tokens=5)
            for rid in (1, 2)]
    with pytest.raises(KvReservationRefused, match=r"needs 50 KV tokens .*, 34 allocatable and not promised"):
        decode.reserve_prefilled(3, RequestSpec(list(range(30, 40)), params))  # 64 - 2 x (10 + 5) left
    for req in reqs:
        decode.admit_prefilled(req, 7)  # the KV content does not matter here
    statuses = {}
    for _ in range(60):
        report = decode.step()
        assert not report.paused
        statuses.update({r.request_id: s for r, s in report.finished})
        if len(statuses) == 2:
            break
    assert FINISH_SEGMENT_KV in statuses.values(), statuses
    assert decode.kv.allocatable_token_num() == 64


def test_the_rank_loop_runs_a_decode_node_through_the_backend_hooks_alone(model, caplog) -> None:
    """ModelRank has one path: a PD node's arrivals, results and commands reach the transfer through the backend."""
    from types import SimpleNamespace

    from lightllm.server.core.objs.io_messages import AddRequests
    from lightllm.server.model_rank.prefill_wait_tracker import PrefillWaitTracker
    from lightllm.server.model_rank.rank_process import ModelRank

    node = Node(model, "decode", PdRankSettings(), kv_tokens=256)
    params = SamplingParams(temperature=0, max_new_tokens=8, ignore_eos=True)
    specs = {1: RequestSpec.build(list(range(5, 25)), params, pd_kind=PD_KIND_DECODE),
             2: RequestSpec.build(list(range(5, 25)), SamplingParams(max_new_tokens=400), pd_kind=PD_KIND_DECODE)}
    cache_lens: Dict[int, int] = {}
    shm = SimpleNamespace(read_request=lambda shm_index, request_id: specs[request_id],
                          set_prompt_cache_len=lambda shm_index, request_id, n: cache_lens.__setitem__(request_id, n))
    tracker = PrefillWaitTracker()
    rank = ModelRank(node.backend, shm, is_leader=True, wait_tracker=tracker)
    with caplog.at_level("WARNING", logger="lightllm.model_rank"):
        rank.apply([AddRequests([(1, 0), (2, 1)]), "not a command"])
    assert "a decode node ignores a str command" in caplog.text
    assert [(m.request_id, m.kind) for m in node.messages if isinstance(m, PdNotice)] == [(1, "reserved"), (2, "busy")]
    assert list(node.backend.requests) == [1] and node.pd.in_flight == [1] and rank._ranks_busy()
    assert cache_lens == {1: 0} and tracker._arrival_s == {}  # a reservation waits for no prefill here
    node.backend.poll()  # no transfer was set up: the receive failed, and every rank agrees on it
    assert not node.backend.has_outside_work
    report = node.backend.step()
    assert {r.request_id: s for r, s in report.finished} == {2: FINISH_BUSY, 1: FINISH_TRANSFER_FAILED}
    assert not node.backend.has_work
