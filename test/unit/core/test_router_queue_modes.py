"""One router queue per run mode, and the router process's shell around it."""

from __future__ import annotations

from contextlib import contextmanager
from typing import Any, Iterator, Tuple

import pytest
from router_queue_test_support import router_req as _req

from lightllm.server.model_rank.scheduling.prefill_queue_strategy.overtake_bound import OvertakeBoundSpec
from lightllm.server.router.req_queue.normal_queue import NormalReqQueue


def test_build_req_queue_picks_each_run_modes_queue():
    from lightllm.server.router.req_queue.decode_arrival_queue import DecodeArrivalQueue
    from lightllm.server.router.req_queue.queue_registry import build_req_queue
    from lightllm.server.run_mode import RunMode

    bound = OvertakeBoundSpec(64, 0.5)
    normal = build_req_queue("normal", 100, 4, overtake_bound=bound)
    assert type(normal) is NormalReqQueue and normal.overtake_bound is bound and normal.capacity_tokens == 100
    assert type(build_req_queue("prefill", 100, 4)) is NormalReqQueue
    assert type(build_req_queue(RunMode.DECODE, 100, 4)) is DecodeArrivalQueue
    for mode in ("pd_master", "nonsense"):
        with pytest.raises(ValueError, match=f"no router queue for run mode '{mode}'"):
            build_req_queue(mode, 100, 4)


def test_decode_arrivals_are_admitted_at_once_whatever_the_limits():
    from lightllm.server.router.req_queue.decode_arrival_queue import DecodeArrivalQueue

    queue = DecodeArrivalQueue(10, 1)  # rank 0 reserves or answers busy per request: no limits here
    for rid in (3, 1, 2, 4):
        queue.append(_req(rid, input_len=50, new=50))
    assert queue.remove_waiting(2).request_id == 2 and queue.remove_waiting(2) is None
    assert len(queue) == 3 and queue.admission_due(0, 1000)
    assert [r.request_id for r in queue.admit()] == [3, 1, 4]  # arrival order
    assert len(queue) == 0 and queue.admit() == []
    assert list(queue.running) == [3, 1, 4] and queue.projected_running_tokens() == 300
    queue.release(1)
    queue.release(99)  # unknown: nothing happens
    assert list(queue.running) == [3, 4] and queue.projected_running_tokens() == 200


def test_normal_queue_admits_on_the_router_cadence():
    queue = NormalReqQueue(1000, 8)
    assert queue.admission_due(0, 3)  # nothing runs: at once
    queue.append(_req(1))
    queue.admit()
    assert not queue.admission_due(2, 3) and queue.admission_due(3, 3)


def test_the_queue_keeps_the_cadence_bookkeeping_itself():
    """``admit_if_due`` counts backend steps from the last round that admitted anything, so the
    router (rank 0's step counter) and the simulator (its own step count) pace admission alike."""
    from lightllm.server.router.req_queue.decode_arrival_queue import DecodeArrivalQueue

    queue = NormalReqQueue(1000, 8)
    assert queue.admit_if_due(50, 3) == []  # nothing waits
    queue.append(_req(1))
    assert [r.request_id for r in queue.admit_if_due(50, 3)] == [1]  # nothing ran: at once
    queue.append(_req(2))
    assert queue.admit_if_due(52, 3) == [] and len(queue) == 1  # two steps since the admission
    assert [r.request_id for r in queue.admit_if_due(53, 3)] == [2]
    queue.append(_req(3))
    assert queue.admit_if_due(55, 3) == []  # counted from the round that admitted request 2
    decode = DecodeArrivalQueue()
    decode.append(_req(4))
    assert [r.request_id for r in decode.admit_if_due(0, 1000)] == [4]
    decode.append(_req(5))
    assert [r.request_id for r in decode.admit_if_due(0, 1000)] == [5]  # never waits for the cadence


@contextmanager
def _router_shell(tmp_path, run_mode: str) -> Iterator[Tuple[Any, Any, Any]]:
    """A RouterManager of ``run_mode`` over fresh segments: yields (router, shm, rank 0's socket)."""
    import uuid

    import zmq

    from lightllm.server.router.manager import RouterConfig, RouterManager
    from lightllm.server.server_layout import ServerLayout

    tag = f"lightllm_test_{uuid.uuid4().hex[:10]}"
    layout = ServerLayout(f"{tag}_req", f"{tag}_stats", 4, 64, 1024,
                          *(f"ipc://{tmp_path}/{name}.sock" for name in ("router", "rank0", "detok", "http")))
    shm, stats = layout.open_requests(create=True), layout.open_stats(create=True)
    ctx = zmq.Context()
    rank0 = ctx.socket(zmq.PULL)
    rank0.bind(layout.model_rank0_address)
    router = RouterManager(RouterConfig(layout, running_max_req_size=8, router_token_ratio=1.0,
                                        router_max_wait_tokens=100, schedule_time_interval=0.01,
                                        log_level="warning", process_name="router", run_mode=run_mode))
    try:
        yield router, shm, rank0
    finally:
        router.zmq_ctx.destroy(linger=0)
        router.shm.close()
        router.stats.close()
        ctx.destroy(linger=0)
        for segment in (shm, stats):
            segment.close()
            segment.unlink()


@pytest.mark.parametrize(("run_mode", "at_once"), [("decode", True), ("normal", False)])
def test_the_router_shell_sends_what_its_modes_queue_admits(tmp_path, run_mode, at_once):
    """The same RouterManager: a decode node's arrival goes to rank 0 while another request runs
    and the cadence is not due, a normal node's waits for the cadence."""
    from lightllm.common.sampling import SamplingParams
    from lightllm.server.core.objs.io_messages import AddRequests, NewRequest
    from lightllm.server.core.objs.request_spec import RequestSpec
    from lightllm.server.core.objs.shm_req_layout import PD_KIND_DECODE, PD_KIND_NONE

    with _router_shell(tmp_path, run_mode) as (router, shm, rank0):
        kind = PD_KIND_DECODE if run_mode == "decode" else PD_KIND_NONE
        for slot, rid in enumerate((1, 2)):
            shm.write_request(slot, rid, RequestSpec.build([5] * 8, SamplingParams(max_new_tokens=4), pd_kind=kind))
        router.handle(NewRequest(1, 0))
        router.admit()
        assert rank0.poll(10_000) and rank0.recv_pyobj() == AddRequests([(1, 0)])  # nothing ran: admitted
        router.handle(NewRequest(2, 1))
        router.admit()  # request 1 runs and the backend has run no step since
        if at_once:
            assert rank0.poll(10_000) and rank0.recv_pyobj() == AddRequests([(2, 1)])
            assert list(router.queue.running) == [1, 2] and len(router.queue) == 0
        else:
            assert list(router.queue.running) == [1] and len(router.queue) == 1


@pytest.mark.parametrize(("run_mode", "pd_kind_name", "reserved"), [
    ("prefill", "PD_KIND_PREFILL", 8 + 1),  # the decode node holds every later token's KV
    ("normal", "PD_KIND_NONE", 8 + 50),
])
def test_a_prefill_nodes_router_reserves_kv_for_the_prompt_and_first_token_only(tmp_path, run_mode,
                                                                                 pd_kind_name, reserved):
    from lightllm.common.sampling import SamplingParams
    from lightllm.server.core.objs import shm_req_layout
    from lightllm.server.core.objs.io_messages import NewRequest
    from lightllm.server.core.objs.request_spec import RequestSpec

    with _router_shell(tmp_path, run_mode) as (router, shm, _rank0):
        spec = RequestSpec.build([5] * 8, SamplingParams(max_new_tokens=50),
                                 pd_kind=getattr(shm_req_layout, pd_kind_name))
        shm.write_request(0, 1, spec)
        router.handle(NewRequest(1, 0))
        assert router.queue.remove_waiting(1).projected_token_num == reserved


def test_the_start_up_lines_name_a_prefill_queue_only_where_there_is_one() -> None:
    """A decode node has no prefill queue (it refuses the strategy and bound flags): its lines say so."""
    from lightllm.server.run_mode import prefill_queue_description

    for mode in ("normal", "prefill"):
        assert prefill_queue_description(mode, "hrrn", "2048 + 0.15 x FCFS wait") == \
            "prefill_queue_strategy=hrrn overtake_bound=2048 + 0.15 x FCFS wait"
    assert prefill_queue_description("decode", "default", "2048 + 0.15 x FCFS wait") == "prefill_queue=none"
