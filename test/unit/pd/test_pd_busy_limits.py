"""A busy answer names the limit that was hit, from the decode rank to the client's 503.

The decode backend refuses a reservation for one of two limits (KV tokens, request slots)
and says which with its numbers; rank 0 sends that as a ``busy`` notice ahead of the
``FINISH_BUSY`` finish; the node's HTTP side puts it in the busy line; the master's 503
``server_busy`` carries it to the client.  The HTTP slot pool's own busy answer names its count.
"""

from __future__ import annotations

import asyncio
from pathlib import Path
from typing import Any, List

import httpx
import pytest
import torch

from pd_master_support import Cluster, generate
from lightllm.common.req_manager import ReqManager
from lightllm.common.sampling import SamplingParams
from lightllm.common.sampling.sampler import Sampler
from lightllm.models.registry import load_model
from lightllm.server.core.objs.finish_status import FINISH_BUSY
from lightllm.server.core.objs.io_messages import PdNotice
from lightllm.server.pd.node.stream_translation import translate
from lightllm.server.pd.protocol.node_events import BUSY
from lightllm.server.httpserver.slot_pool import SlotPool
from lightllm.server.manager_errors import ServerBusyError
from lightllm.server.request_manager import GenerationEvent
from lightllm.server.model_rank.kv_cache.infer_context import InferenceContext
from lightllm.server.model_rank.scheduling.backend_registry import KvReservationRefused
from lightllm.server.model_rank.scheduling.decode_backend import LIMIT_KV_TOKENS, LIMIT_REQUEST_SLOTS
from lightllm.server.model_rank.scheduling.prefill_queue_strategy import build_prefill_queue_strategy
from lightllm.server.model_rank.execution.rank_backend import build_rank_backend
from lightllm.server.model_rank.scheduling.step_planner import StepPlanner
from lightllm.server.model_rank.pd_transfer.decode import DecodeRankTransfer
from lightllm.server.model_rank.rank_config import PdRankSettings
from lightllm.server.core.objs.request_spec import RequestSpec

MAX_LEN = 400


@pytest.fixture(scope="module")
def model(tiny_llama_dir):
    return load_model(str(tiny_llama_dir), dtype=torch.float32)


def _decode_backend(model, kv_tokens: int, rows: int):
    context = InferenceContext(model.new_kv_cache(kv_tokens), ReqManager(rows, MAX_LEN + 1))
    return build_rank_backend("decode", model, context, build_prefill_queue_strategy("hrrn"),
                              StepPlanner(64, 32), Sampler(0), [2], MAX_LEN)


def _greedy(max_new: int) -> SamplingParams:
    return SamplingParams(temperature=0, max_new_tokens=max_new, ignore_eos=True)


def test_kv_limit_is_named_with_needed_and_free_tokens(model) -> None:
    decode = _decode_backend(model, kv_tokens=100, rows=8)
    decode.reserve_prefilled(1, RequestSpec(list(range(5, 45)), _greedy(20)))
    with pytest.raises(KvReservationRefused) as refused:
        decode.reserve_prefilled(2, RequestSpec(list(range(5, 55)), _greedy(30)))
    assert refused.value.limit == LIMIT_KV_TOKENS
    assert str(refused.value) == ("no KV to reserve: request 2 needs 80 KV tokens (prompt 50 + 30 to generate), "
                                  "40 allocatable and not promised; held: no other request takes the KV it waits for")
    assert list(decode.requests) == [1]


def test_request_slot_limit_is_named_with_the_slot_count(model) -> None:
    decode = _decode_backend(model, kv_tokens=2048, rows=2)
    assert decode.kv.max_requests() == 2  # the KV view's rows: the request manager's
    for request_id in (1, 2):
        decode.reserve_prefilled(request_id, RequestSpec(list(range(5, 15)), _greedy(4)))
    free = decode.kv.allocatable_token_num()
    with pytest.raises(KvReservationRefused) as refused:
        decode.reserve_prefilled(3, RequestSpec(list(range(5, 15)), _greedy(4)))
    assert refused.value.limit == LIMIT_REQUEST_SLOTS
    assert str(refused.value) == ("no request slot to reserve: all 2 request slots (--running_max_req_size) "
                                  "are in use")
    assert list(decode.requests) == [1, 2] and decode.kv.allocatable_token_num() == free  # nothing changed


def _no_handle(*args: Any) -> Any:
    raise AssertionError("a busy answer needs no transfer handle")


@pytest.mark.parametrize(("rows", "kv_tokens", "limit", "words"),
                         [(1, 2048, LIMIT_REQUEST_SLOTS, "all 1 request slots"),
                          (8, 64, LIMIT_KV_TOKENS, "needs 340 KV tokens (prompt 40 + 300 to generate)")])
def test_rank0_sends_a_busy_notice_naming_the_limit_before_the_busy_finish(model, rows, kv_tokens, limit,
                                                                            words) -> None:
    backend = _decode_backend(model, kv_tokens=kv_tokens, rows=rows)
    if rows == 1:
        backend.reserve_prefilled(1, RequestSpec(list(range(5, 15)), _greedy(4)))
    messages: List[Any] = []
    pd = DecodeRankTransfer(0, PdRankSettings(), _no_handle, notify=messages.append)
    assert pd.reserve(backend, 2, -1, RequestSpec(list(range(5, 45)), _greedy(300))) is None
    notices = [m for m in messages if isinstance(m, PdNotice) and m.request_id == 2]
    assert [(n.kind, n.error_kind) for n in notices] == [("busy", limit)]
    assert words in notices[0].message
    report = backend.step()
    assert [(r.request_id, s) for r, s in report.finished if r.request_id == 2] == [(2, FINISH_BUSY)]


def test_a_busy_notice_says_when_a_kv_hold_blocked_the_request(model) -> None:
    # The first request refused for KV is held: a smaller one that would fit is told why it does not.
    backend = _decode_backend(model, kv_tokens=100, rows=8)
    messages: List[Any] = []
    pd = DecodeRankTransfer(0, PdRankSettings(), _no_handle, notify=messages.append)
    backend.reserve_prefilled(1, RequestSpec(list(range(5, 45)), _greedy(20)))  # 60 of 100
    assert backend.kv.capacity_token_num() == 100
    assert pd.reserve(backend, 2, -1, RequestSpec(list(range(5, 65)), _greedy(20))) is None  # needs 80
    assert pd.reserve(backend, 3, -1, RequestSpec(list(range(5, 15)), _greedy(10))) is None  # needs 20
    busy = {m.request_id: m.message for m in messages if isinstance(m, PdNotice) and m.kind == "busy"}
    assert busy[2].endswith("40 allocatable and not promised; held: no other request takes the KV it waits for")
    assert busy[3].endswith("40 allocatable and not promised, 40 of them held for request 2, refused earlier")
    assert list(backend.requests) == [1]


def _busy_finish(request_id: int) -> GenerationEvent:
    return GenerationEvent(request_id=request_id, token_id=-1, text="", logprob=0.0, finish_reason="busy",
                           prompt_tokens=4, cached_tokens=0, completion_tokens=0)


def test_the_node_busy_line_carries_rank0s_reason() -> None:
    # The notice came ahead of the finish in the request's stream (see test_pd_node_service.py).
    notice = PdNotice(7, "busy", error_kind=LIMIT_REQUEST_SLOTS,
                      message="no request slot to reserve: all 2 request slots (--running_max_req_size) are in use")
    events = translate(_busy_finish(7), 7, {"busy": notice}, first_on_decode=True)
    assert [(e.kind, e.message) for e in events] == [
        (BUSY, "request 7: no request slot to reserve: all 2 request slots (--running_max_req_size) are in use")]


def test_the_slot_pool_busy_answer_names_its_slot_count() -> None:
    async def take_two() -> None:
        pool = SlotPool(1, wait_seconds=0.01)
        pool.start()
        await pool.take()
        with pytest.raises(ServerBusyError, match=r"^server is busy: all 1 shared-memory request slots are in use "
                                                  r"and none became free within 0.01 s$"):
            await pool.take()
        with pytest.raises(ServerBusyError, match=r"^server is busy: all 1 shared-memory request slots are in use$"):
            await pool.take(0)

    asyncio.run(take_two())


def test_the_clients_503_names_the_busy_role_and_the_limit(tiny_llama_dir: Path,
                                                          monkeypatch: pytest.MonkeyPatch) -> None:
    # The answer at once (the default is 60 s of retries).
    monkeypatch.setenv("LIGHTLLM_PD_NODE_BUSY_RETRY_TIMEOUT_SECONDS", "0")
    cluster = Cluster(str(tiny_llama_dir))
    try:
        _busy_answer_names_the_limit(cluster)
    finally:
        cluster.stop()


def _busy_answer_names_the_limit(cluster: Cluster) -> None:
    cluster.decode.busy = True
    cluster.decode.busy_message = ("request 1: no KV to reserve: request 1 needs 80 KV tokens (prompt 50 + 30 to "
                                   "generate), 40 allocatable and not promised")
    response = generate(cluster, "hello", 4)
    assert response.status_code == 503, response.text
    error = response.json()["error"]
    assert (error["code"], error["role"]) == ("server_busy", "decode")
    assert error["message"] == f"The decode node is busy: {cluster.decode.busy_message}; retry later"
    assert httpx.get(f"{cluster.master.url}/health").status_code == 200
