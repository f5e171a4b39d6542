"""What a PD node tells its master with every registration and heartbeat: its load and state.

The client is the real :class:`PdNodeClient` over real HTTP (uvicorn on loopback); the master
is a small recording app that answers like the membership endpoints, in two versions: a
current one that takes ``load``/``state``, and an older one that refuses any field it does
not know with a 400 naming it (as the master did before nodes reported load).  The load
itself is :func:`node_report` over a real :class:`PdNodeService` and real shared counters.
"""

from __future__ import annotations

import asyncio
import time
import uuid
from typing import Any, Callable, Dict, List

import pytest
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse

from lightllm.common.sampling import SamplingParams
from lightllm.server.core.objs.request_spec import RequestSpec
from lightllm.server.core.objs.shm_req_layout import PD_KIND_PREFILL
from lightllm.server.core.objs.shm_stats import ShmStats
from lightllm.server.launch.pd_node import node_report
from lightllm.server.pd.node.registration_client import PdNodeClient
from lightllm.server.pd.node.service import PdNodeService
from lightllm.server.pd.protocol.membership import DEREGISTER_PATH, HEARTBEAT_PATH, LOAD_KEY, REGISTER_PATH, STATE_KEY
from lightllm.server.pd.protocol.node_info import NodeInfo

from pd_membership_support import node
from test_pd_node_epochs import ScriptedHost, token
from uvicorn_in_thread import ThreadServer

LOAD_NAMES = {"queued_prefill_tokens", "running_requests", "free_kv_tokens", "kv_capacity_tokens"}


class RecordingMaster:
    """Answers registrations and heartbeats at ``interval_s`` and keeps every body it got."""

    def __init__(self, interval_s: float, old: bool = False, forget_at_heartbeat: int = 0) -> None:
        self.bodies: Dict[str, List[Dict[str, Any]]] = {REGISTER_PATH: [], HEARTBEAT_PATH: [], DEREGISTER_PATH: []}
        # Answer this heartbeat (1-based; 0: none) with 404 unknown_node, as a master that dropped the node.
        self.forget_at_heartbeat = forget_at_heartbeat
        app = FastAPI()
        allowed = {REGISTER_PATH: set(NodeInfo.__dataclass_fields__), HEARTBEAT_PATH: {"node_id"},
                   DEREGISTER_PATH: {"node_id"}}
        answer = {"master_id": "m1", "heartbeat_interval_s": interval_s, "max_missed_heartbeats": 3,
                  "cluster_key": False}

        async def accept(request: Request) -> JSONResponse:
            path = request.url.path
            body = await request.json()
            unknown = sorted(set(body) - allowed[path])
            if old and unknown:
                error = {"message": f"unknown field(s): {', '.join(unknown)}", "type": "invalid_request_error",
                         "param": unknown[0], "code": None}
                return JSONResponse({"error": error}, status_code=400)
            self.bodies[path].append(body)
            if path == DEREGISTER_PATH:
                return JSONResponse({"node_id": body["node_id"], "dropped": True, "message": "left"})
            if path == HEARTBEAT_PATH and len(self.bodies[path]) == self.forget_at_heartbeat:
                error = {"message": f"node {body['node_id']!r} is not registered", "type": "not_found_error",
                         "param": "node_id", "code": "unknown_node"}
                return JSONResponse({"error": error}, status_code=404)
            return JSONResponse({"node_id": body["node_id"], **answer})

        app.add_api_route(REGISTER_PATH, accept, methods=["POST"])
        app.add_api_route(HEARTBEAT_PATH, accept, methods=["POST"])
        if not old:
            app.add_api_route(DEREGISTER_PATH, accept, methods=["POST"])
        self.server = ThreadServer(app)
        self.url = f"http://127.0.0.1:{self.server.port}"

    def stop(self) -> None:
        self.server.stop()


async def until(predicate: Callable[[], bool], what: str, timeout: float = 20) -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        await asyncio.sleep(0.02)


def run_client_until(master: RecordingMaster, make_client: Callable[[], PdNodeClient], done: Callable[[], bool],
                     what: str) -> PdNodeClient:
    """Run a node client against ``master`` until it registered and ``done()``; stop both, return the client."""

    async def run() -> PdNodeClient:
        client = make_client()
        client.start()
        try:
            await client.wait_registered(20)
            await until(done, what)
        finally:
            await client.stop()
        return client

    try:
        return asyncio.run(run())
    finally:
        master.stop()


def test_every_registration_and_heartbeat_carries_the_callbacks_load_and_state() -> None:
    master = RecordingMaster(0.1)
    reports = iter(range(1000))

    def report() -> Dict[str, Any]:
        n = next(reports)
        return {LOAD_KEY: {"queued_prefill_tokens": n, "running_requests": 2, "free_kv_tokens": 100 - n,
                           "kv_capacity_tokens": 100},
                STATE_KEY: "serving" if n < 3 else "draining", "not_a_report_field": 1}

    run_client_until(master, lambda: PdNodeClient(master.url, node("d0", "decode"), heartbeat_interval_s=0.1,
                                                  report=report),
                     lambda: len(master.bodies[HEARTBEAT_PATH]) >= 4, "four heartbeats")
    registration = master.bodies[REGISTER_PATH][0]
    assert registration[LOAD_KEY]["queued_prefill_tokens"] == 0 and registration[STATE_KEY] == "serving"
    assert registration["model_name"] == "tiny"  # the NodeInfo fields are all still there
    beats = master.bodies[HEARTBEAT_PATH]
    assert all(set(beat) == {"node_id", LOAD_KEY, STATE_KEY} for beat in beats)  # only the contract's fields
    # Each beat reads the callback afresh.
    assert [beat[LOAD_KEY]["queued_prefill_tokens"] for beat in beats[:3]] == [1, 2, 3]
    assert [beat[STATE_KEY] for beat in beats[:3]] == ["serving", "serving", "draining"]
    assert beats[0][LOAD_KEY] == {"queued_prefill_tokens": 1, "running_requests": 2, "free_kv_tokens": 99,
                                  "kv_capacity_tokens": 100}


def test_an_older_master_gets_plain_bodies_and_keeps_the_node() -> None:
    master = RecordingMaster(0.1, old=True)

    report = lambda: {LOAD_KEY: {"running_requests": 1}, STATE_KEY: "serving"}  # noqa: E731
    client = run_client_until(
        master, lambda: PdNodeClient(master.url, node("d0", "decode"), heartbeat_interval_s=0.1, report=report),
        lambda: len(master.bodies[HEARTBEAT_PATH]) >= 3, "three heartbeats")
    assert client.refusal is None and not client.master_lost and client.registrations == 1
    assert set(master.bodies[REGISTER_PATH][0]) == set(NodeInfo.__dataclass_fields__)
    assert all(beat == {"node_id": "d0"} for beat in master.bodies[HEARTBEAT_PATH])


def test_a_master_that_forgot_the_node_is_told_so_before_the_node_registers_again() -> None:
    """The node releases what the forgotten membership held (its pairs) before the master can set up new ones."""
    master = RecordingMaster(0.1, forget_at_heartbeat=2)
    seen: List[Any] = []

    async def forgot(message: str) -> None:
        seen.append(("forgot", message, len(master.bodies[REGISTER_PATH])))
        await asyncio.sleep(0.3)  # the teardown takes a while: registering must wait for it
        seen.append(("done", len(master.bodies[REGISTER_PATH])))

    def registered_after_the_teardown() -> bool:
        return bool(seen) and seen[-1][0] == "done" and len(master.bodies[REGISTER_PATH]) > seen[-1][1]

    client = run_client_until(
        master, lambda: PdNodeClient(master.url, node("d0", "decode"), heartbeat_interval_s=0.1, on_master_forgot=forgot),
        registered_after_the_teardown, "a registration after the forgotten node's teardown")
    # On a loaded machine a 0.1 s heartbeat may also be missed and the node register again on its
    # own before the master forgets it: what matters is that none comes during the teardown.
    (first, message, before), done = seen
    assert (first, message) == ("forgot", "node 'd0' is not registered") and done == ("done", before)
    assert not client.master_lost


def test_a_failing_report_does_not_stop_the_heartbeats() -> None:
    master = RecordingMaster(0.1)

    def report() -> Dict[str, Any]:
        raise RuntimeError("stats segment gone")

    run_client_until(master, lambda: PdNodeClient(master.url, node("d0", "decode"), heartbeat_interval_s=0.1,
                                                  report=report),
                     lambda: len(master.bodies[HEARTBEAT_PATH]) >= 2, "two heartbeats")
    assert master.bodies[HEARTBEAT_PATH][0] == {"node_id": "d0"}


def test_beat_now_sends_the_next_heartbeat_without_waiting_for_the_interval() -> None:
    # The master's interval is far longer than the test's wait: only beat_now can bring the beat.
    master = RecordingMaster(600.0)
    state = {"value": "serving"}

    async def run() -> None:
        client = PdNodeClient(master.url, node("p0", "prefill"), heartbeat_interval_s=600.0,
                              report=lambda: {STATE_KEY: state["value"]})
        client.start()
        try:
            await client.wait_registered(20)
            state["value"] = "draining"
            client.beat_now()
            await until(lambda: bool(master.bodies[HEARTBEAT_PATH]), "the heartbeat beat_now asked for")
        finally:
            await client.stop()

    try:
        asyncio.run(run())
    finally:
        master.stop()
    assert master.bodies[REGISTER_PATH][0][STATE_KEY] == "serving"
    assert master.bodies[HEARTBEAT_PATH] == [{"node_id": "p0", STATE_KEY: "draining"}]


def test_a_beat_asked_for_right_before_stopping_is_still_sent() -> None:
    master = RecordingMaster(600.0)

    async def run() -> None:
        client = PdNodeClient(master.url, node("p0", "prefill"), heartbeat_interval_s=600.0,
                              report=lambda: {STATE_KEY: "draining"})
        client.start()
        await client.wait_registered(20)
        client.beat_now()
        await client.stop()  # before the client's loop got to run again

    try:
        asyncio.run(asyncio.wait_for(run(), 60))
    finally:
        master.stop()
    assert master.bodies[HEARTBEAT_PATH] == [{"node_id": "p0", STATE_KEY: "draining"}]


@pytest.fixture
def stats():
    segment = ShmStats(f"test_pd_report_{uuid.uuid4().hex[:8]}", create=True)
    yield segment
    segment.close()
    segment.unlink()


def test_the_report_reads_the_shared_kv_counters_and_the_services_requests(stats: ShmStats) -> None:
    stats.set("kv_total_tokens", 1000)
    stats.set("kv_allocatable_tokens", 700)
    stats.set("kv_promised_tokens", 150)  # a decode node's reservations may still take these
    host = ScriptedHost()
    prefill = PdNodeService(host, "prefill", 1.0, "ipc:///unused")
    prefill.epochs[1] = None

    async def scenario() -> List[Dict[str, Any]]:
        seen = [node_report(prefill, stats)]
        first = prefill.generate(RequestSpec.build(list(range(1, 31)), SamplingParams(max_new_tokens=2),
                                                   pd_kind=PD_KIND_PREFILL), request_id=1, epoch=1)
        second = prefill.generate(RequestSpec.build(list(range(1, 11)), SamplingParams(max_new_tokens=2),
                                                    pd_kind=PD_KIND_PREFILL), request_id=2, epoch=1)
        reader = asyncio.ensure_future(first.__anext__())
        other = asyncio.ensure_future(second.__anext__())
        await until(lambda: len(host.submitted) == 2, "both requests to reach the manager")
        seen.append(node_report(prefill, stats))
        host.feed(1, token(1, 5))  # request 1's first token: its prefill is done
        await asyncio.wait_for(reader, 20)
        seen.append(node_report(prefill, stats))
        host.feed(2, token(2, 6, "length"), None)  # request 2 finishes with its first token
        await asyncio.wait_for(other, 20)
        await first.aclose()  # the master closed request 1's stream
        with pytest.raises(StopAsyncIteration):
            await asyncio.wait_for(second.__anext__(), 20)
        seen.append(node_report(prefill, stats))
        return seen

    idle, both_queued, one_queued, done = asyncio.run(asyncio.wait_for(scenario(), 60))
    assert idle == {LOAD_KEY: {"queued_prefill_tokens": 0, "running_requests": 0, "free_kv_tokens": 550,
                               "kv_capacity_tokens": 1000}, STATE_KEY: "serving"}
    assert set(idle[LOAD_KEY]) == LOAD_NAMES
    assert (both_queued[LOAD_KEY]["queued_prefill_tokens"], both_queued[LOAD_KEY]["running_requests"]) == (40, 2)
    assert (one_queued[LOAD_KEY]["queued_prefill_tokens"], one_queued[LOAD_KEY]["running_requests"]) == (10, 2)
    assert (done[LOAD_KEY]["queued_prefill_tokens"], done[LOAD_KEY]["running_requests"]) == (0, 0)
    assert host.closed == [1, 2]
    prefill.start_draining()
    assert node_report(prefill, stats)[STATE_KEY] == "draining"
    # A decode node prefills nothing itself; without counters every KV number is 0.
    decode = PdNodeService(ScriptedHost(), "decode", 1.0, "ipc:///unused")
    assert node_report(decode, None)[LOAD_KEY] == {"queued_prefill_tokens": 0, "running_requests": 0,
                                                   "free_kv_tokens": 0, "kv_capacity_tokens": 0}
