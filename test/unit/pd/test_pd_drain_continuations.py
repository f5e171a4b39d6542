"""A draining node keeps serving the continuation segments of generations already streaming.

SIGTERM on the only prefill node used to cut off every client mid-stream whose generation needed
one more segment ("every prefill node is draining"), though the node's grace period was far from
spent.  Now a continuation goes to a serving node of the role when there is one, else to a draining
one, which takes it (new requests still get busy), and the master's heartbeat answers tell a
draining node how many generations may still continue on it, so its drain waits for them.
"""

from __future__ import annotations

import asyncio
import dataclasses
import json
import threading
import types
from typing import Any, Dict, List

import httpx

from lightllm.server.core.objs.request_spec import Segment
from lightllm.server.launch.supervisor import Supervisor
from lightllm.server.pd.node.service import PdNodeService
from lightllm.server.request_gate import RequestGate
from lightllm.server.manager_errors import ServerUnavailableError

from pd_master_support import Cluster, cluster_fixture  # noqa: F401 - the "cluster" fixture
from pd_node_stand_in import REQUEST_TIMEOUT, reference_tokens
from test_pd_node_epochs import ScriptedHost, spec, token
from test_pd_node_heartbeat import until


def _stream(cluster: Cluster, max_new_tokens: int, out: Dict[str, Any]) -> None:
    body = {"inputs": "a long story", "parameters": {"max_new_tokens": max_new_tokens}}
    events: List[Dict[str, Any]] = []
    with httpx.stream("POST", f"{cluster.master.url}/generate_stream", json=body, timeout=REQUEST_TIMEOUT) as response:
        for line in response.iter_lines():
            if line.startswith("data:"):
                events.append(json.loads(line[len("data:"):]))
    out["events"] = events


def _heartbeat_answer(cluster: Cluster, node_id: str) -> Dict[str, Any]:
    response = httpx.post(f"{cluster.master.url}/pd/heartbeat", json={"node_id": node_id, "state": "draining"},
                          timeout=REQUEST_TIMEOUT)
    assert response.status_code == 200, response.text
    return response.json()


def test_a_streaming_request_continues_on_the_only_prefill_node_while_it_drains(cluster: Cluster) -> None:
    cluster.decode.segment_limit = 2
    cluster.decode.token_delay = 0.02
    cluster.decode.hold_after = 1  # the first segment pauses until the prefill node drains
    out: Dict[str, Any] = {}
    client = threading.Thread(target=_stream, args=(cluster, 12, out))
    client.start()
    until_sync(lambda: len(cluster.prefill.bodies) == 1, "the first segment")
    cluster.prefill.report(state="draining")
    # The draining node learns that a generation in flight may still continue on it.
    pending = _heartbeat_answer(cluster, cluster.prefill.node_id).get("continuations_pending")
    cluster.decode.hold_after = None
    cluster.decode.release_hold()
    client.join(60)
    events = out["events"]
    assert all("error" not in event for event in events), events
    tokens = [event["token"]["id"] for event in events if event.get("token")]
    prompt = cluster.master.manager.served.encode_prompt("a long story")
    assert tokens == reference_tokens(prompt, 12)
    assert pending == 1
    assert [body["segment_index"] for body in cluster.prefill.bodies][1:] != []  # continued on the draining P
    # A new request is still refused: every prefill node drains.
    refused = httpx.post(f"{cluster.master.url}/generate", json={"inputs": "x", "parameters": {"max_new_tokens": 2}},
                         timeout=REQUEST_TIMEOUT)
    assert refused.status_code == 503 and "draining" in refused.text
    # Nothing in flight: the drain may end.
    assert _heartbeat_answer(cluster, cluster.prefill.node_id)["continuations_pending"] == 0


def test_continuations_go_to_a_serving_prefill_node_when_one_is_left(cluster: Cluster) -> None:
    other = cluster.add("prefill")
    cluster.decode.segment_limit = 2
    cluster.prefill.report(state="draining")
    # A serving prefill node takes every segment: the draining one waits for nothing.
    pending = _heartbeat_answer(cluster, cluster.prefill.node_id).get("continuations_pending")
    out: Dict[str, Any] = {}
    _stream(cluster, 9, out)
    assert all("error" not in event for event in out["events"])
    assert [body["segment_index"] for body in other.bodies] == [0, 1, 2]
    assert cluster.prefill.bodies == []
    assert pending == 0


def until_sync(condition: Any, what: str, timeout: float = 30) -> None:
    import time

    deadline = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.01)


def test_a_draining_node_takes_continuation_segments_but_not_first_ones() -> None:
    host = ScriptedHost()
    service = PdNodeService(host, "decode", 1.0, "ipc:///unused")
    service.epochs[2] = None
    service.start_draining()
    continuation = dataclasses.replace(spec(), segment=Segment(1, 3))

    async def scenario() -> Dict[str, Any]:
        refused = [event async for event in service.generate(spec(), request_id=1, epoch=2)]
        held = service.generate(continuation, request_id=2, epoch=2)
        host.feed(2, token(2, 5, "length"), None)
        taken = [event async for event in held]
        return {"refused": refused, "taken": taken}

    result = asyncio.run(asyncio.wait_for(scenario(), 60))
    assert [event.kind for event in result["refused"]] == ["busy"]
    assert [event.token.token_id for event in result["taken"]] == [5]
    assert [request_id for request_id, _ in host.submitted] == [2]


def test_the_gate_lets_exempt_requests_start_while_draining_not_once_closed() -> None:
    gate = RequestGate()
    gate.drain("shutting down", "server_shutting_down")
    gate.check(None, drain_exempt=True)
    try:
        gate.check(None)
        raise AssertionError("a new request started while draining")
    except ServerUnavailableError:
        pass
    gate.close("stopped", "server_shutting_down")
    try:
        gate.check(None, drain_exempt=True)
        raise AssertionError("an exempt request started after the gate closed")
    except ServerUnavailableError:
        pass


class _IdleServer:
    """A supervised server that is idle at once: only the drain hold can keep it up."""

    loop = None

    def refuse_new_requests(self, message: str, code: str) -> None:
        pass

    def fail_pending(self, message: str, code: str, backend_alive: bool) -> int:
        return 0

    async def wait_until_idle(self, timeout: float) -> bool:
        return True


def test_a_drain_hold_keeps_an_idle_server_until_it_clears() -> None:
    held = {"on": True}

    async def scenario() -> List[bool]:
        manager = _IdleServer()
        manager.loop = asyncio.get_running_loop()
        supervisor = Supervisor(manager, graceful_shutdown_seconds=30)
        supervisor.server = types.SimpleNamespace(should_exit=False)
        supervisor.add_drain_hold(lambda: held["on"])
        supervisor.stop_signal(15)
        await asyncio.sleep(0.5)
        seen = [supervisor.server.should_exit]
        held["on"] = False
        await until(lambda: supervisor.server.should_exit, "the drain to end")
        return seen

    assert asyncio.run(asyncio.wait_for(scenario(), 60)) == [False]


# ---------------------------------------------------------------- review follow-ups


def test_a_draining_prefill_node_gets_no_continuation_while_a_serving_one_exists_even_busy() -> None:
    from pd_membership_support import FakeClock, node
    from lightllm.server.pd.master.node_registry import NodeRegistry
    from lightllm.server.pd.master.node_selector import NodeSelector

    registry = NodeRegistry(clock=FakeClock())
    registry.register(node("p0", "prefill", port=9500), node_state="draining")
    registry.register(node("p1", "prefill", port=9510))
    selector = NodeSelector(registry)
    # p1 serves: the draining p0 was told no continuation comes (it may be gone), even while
    # p1 is only busy (excluded for this attempt): the busy policy waits for p1 instead.
    assert [info.node_id for info in selector.candidates("prefill", continuation=True)] == ["p1"]
    assert selector.candidates("prefill", exclude={"p1"}, continuation=True) == []
    # No prefill node serves any more: the draining one takes continuations, never new requests.
    registry.heartbeat("p1", node_state="draining")
    assert [info.node_id for info in selector.candidates("prefill", continuation=True)] == ["p0", "p1"]
    assert selector.candidates("prefill") == []


def _client() -> Any:
    from pd_membership_support import node
    from lightllm.server.pd.node.registration_client import PdNodeClient

    client = PdNodeClient("http://127.0.0.1:1", node("p0", "prefill"), report=lambda: {"state": "draining"})
    client.registered = True
    return client


def _answer(**extra: Any) -> Dict[str, Any]:
    return {"master_id": "m", "heartbeat_interval_s": 2.0, "max_missed_heartbeats": 3, **extra}


def test_the_node_client_waits_only_while_this_master_says_continuations_may_come() -> None:
    client = _client()
    assert client.continuations_may_come()  # the master has not heard of the drain yet
    client.continuations.sent("draining")
    client._accepted(_answer(continuations_pending=2))
    assert client.continuations_may_come()
    client._accepted(_answer(continuations_pending=0))
    assert not client.continuations_may_come()
    # An older master answers without the field: it sends a draining node nothing, so no wait.
    client._accepted(_answer())
    assert not client.continuations_may_come()
    # A lost master sends nothing either.
    client._accepted(_answer(continuations_pending=1))
    client.master_lost = True
    assert not client.continuations_may_come()


def test_a_drain_hold_that_never_clears_ends_with_the_graceful_period() -> None:
    import logging
    import time

    failures: List[logging.LogRecord] = []

    class Collect(logging.Handler):
        def emit(self, record: logging.LogRecord) -> None:
            if "drain hold failed" in record.getMessage():
                failures.append(record)

    def broken() -> bool:
        raise RuntimeError("broken hold")

    async def scenario() -> float:
        manager = _IdleServer()
        manager.loop = asyncio.get_running_loop()
        supervisor = Supervisor(manager, graceful_shutdown_seconds=1)
        supervisor.server = types.SimpleNamespace(should_exit=False)
        supervisor.add_drain_hold(broken)
        supervisor.add_drain_hold(lambda: True)  # the master keeps saying continuations may come
        started = time.monotonic()
        supervisor.stop_signal(15)
        await until(lambda: supervisor.server.should_exit, "the graceful period to end the drain")
        return time.monotonic() - started

    handler = Collect()
    logging.getLogger("lightllm").addHandler(handler)
    try:
        took = asyncio.run(asyncio.wait_for(scenario(), 60))
    finally:
        logging.getLogger("lightllm").removeHandler(handler)
    assert 0.9 <= took < 10
    assert len(failures) == 1  # polled many times, logged once
