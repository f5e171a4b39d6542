"""A PD node that gets SIGTERM drains: it says so to the master at once, answers new PD requests
busy (naming the drain) and lets the requests it holds finish before it exits.

The service is the real :class:`PdNodeService` over a scripted request manager; the signal
path is the real :class:`Supervisor` and :class:`PdNodeRuntime` wiring, with the node's real
master client heartbeating to a recording master over loopback HTTP.
"""

from __future__ import annotations

import asyncio
import signal
import types
from typing import Any, List, Optional

from fastapi import FastAPI

from lightllm.server.core.objs.shm_req_layout import PD_KIND_PREFILL
from lightllm.server.launch.arg_parser import make_argument_parser
from lightllm.server.launch.pd_node import PdNodeRuntime
from lightllm.server.launch.supervisor import Supervisor
from lightllm.server.manager_errors import ServerUnavailableError
from lightllm.server.pd.node.service import PdNodeService
from lightllm.server.pd.protocol.membership import DEREGISTER_PATH, HEARTBEAT_PATH, STATE_KEY
from lightllm.server.pd.protocol.node_info import NodeInfo

from pd_membership_support import node
from test_pd_node_epochs import ScriptedHost, spec, token
from test_pd_node_heartbeat import RecordingMaster, until


def test_new_requests_are_busy_naming_the_drain_while_held_ones_finish() -> None:
    host = ScriptedHost()
    service = PdNodeService(host, "decode", 1.0, "ipc:///unused")
    service.epochs[2] = None

    async def scenario() -> dict:
        held = service.generate(spec(), request_id=1, epoch=2)
        host.feed(1, token(1, 5))
        first = await asyncio.wait_for(held.__anext__(), 20)
        service.start_draining()
        refused = [event async for event in service.generate(spec(), request_id=2, epoch=2)]
        running_while_draining = service.running_requests
        host.feed(1, token(1, 6), token(1, 7, "length"), None)
        rest = [event async for event in held]
        return {"first": first, "refused": refused, "rest": rest, "running": running_while_draining}

    result = asyncio.run(asyncio.wait_for(scenario(), 60))
    assert [(e.kind, e.message) for e in result["refused"]] == [
        ("busy", "request 2: this decode node is draining (shutting down) and takes no new requests")]
    assert [request_id for request_id, _ in host.submitted] == [1]  # the refused one never reached the manager
    assert result["running"] == 1
    # The held request ran to its end, and the node holds nothing now.
    assert [e.token.token_id for e in [result["first"], *result["rest"]]] == [5, 6, 7]
    assert result["rest"][-1].token.finish_reason == "length"
    assert service.running_requests == 0 and service.state == "draining"


def test_a_request_the_manager_refuses_after_the_drain_began_is_busy_too() -> None:
    # Accepted by the service a moment before the drain, then refused by the manager, which the
    # supervisor closed meanwhile: nothing ran, so the master may place it elsewhere.
    host = ScriptedHost()

    async def refusing_generate(spec_: Any, **kwargs: Any):
        service.start_draining()
        raise ServerUnavailableError("The server is shutting down and takes no new requests", "server_shutting_down")
        yield  # an async generator

    host.generate = refusing_generate
    service = PdNodeService(host, "prefill", 1.0, "ipc:///unused")
    service.epochs[1] = None

    async def scenario() -> List[Any]:
        return [event async for event in service.generate(spec(PD_KIND_PREFILL), request_id=4, epoch=1)]

    events = asyncio.run(asyncio.wait_for(scenario(), 60))
    assert [e.kind for e in events] == ["busy"] and "draining" in events[0].message


def test_a_request_the_graceful_deadline_ends_before_its_first_token_is_busy_naming_the_deadline() -> None:
    # A prefill still queued when --graceful_shutdown_seconds ran out: its client has seen nothing,
    # so the master places it elsewhere; the message says it was ended, not that it was new.
    host = ScriptedHost()
    deadline = "The server is shutting down: the request did not finish within the graceful shutdown period (3s)"

    async def ended_at_the_deadline(spec_: Any, **kwargs: Any):
        service.start_draining()
        raise ServerUnavailableError(deadline, "server_shutting_down")
        yield  # an async generator

    host.generate = ended_at_the_deadline
    service = PdNodeService(host, "prefill", 1.0, "ipc:///unused")
    service.epochs[1] = None

    async def scenario() -> List[Any]:
        return [event async for event in service.generate(spec(PD_KIND_PREFILL), request_id=7, epoch=1)]

    (event,) = asyncio.run(asyncio.wait_for(scenario(), 60))
    assert event.kind == "busy"
    assert event.message == f"request 7: this prefill node is draining (shutting down): {deadline}"
    assert "no new requests" not in event.message


class DrainingManager(ScriptedHost):
    """The supervisor's side of the request manager, recording the order of the calls."""

    def __init__(self) -> None:
        super().__init__()
        self.loop: Optional[asyncio.AbstractEventLoop] = None
        self.calls: List[str] = []
        self.stats = None

    def refuse_new_requests(self, message: str, code: str) -> None:
        self.calls.append("refuse_new_requests")

    def fail_pending(self, message: str, code: str, backend_alive: bool) -> int:
        self.calls.append("fail_pending")
        return 0

    async def wait_until_idle(self, timeout: float) -> bool:
        self.calls.append("wait_until_idle")
        return True


def _runtime(master: RecordingMaster, manager: DrainingManager) -> tuple[PdNodeRuntime, NodeInfo]:
    port = master.url.rsplit(":", 1)[1]
    args = make_argument_parser().parse_args([
        "--model_dir", "m", "--run_mode", "decode", "--pd_master_ip", "127.0.0.1", "--pd_master_port", port,
        "--pd_heartbeat_interval", "600"])
    info = node("d0", "decode")
    return PdNodeRuntime(args, info, manager, "ipc:///unused-rank0"), info


def test_sigterm_sets_draining_tells_the_master_at_once_and_then_drains() -> None:
    # The master's interval is far longer than the test's waits: the draining heartbeat can
    # only be the one the signal asked for.
    master = RecordingMaster(600.0)
    manager = DrainingManager()
    runtime, _ = _runtime(master, manager)
    supervisor = Supervisor(manager, graceful_shutdown_seconds=30)
    server = types.SimpleNamespace(started=True, should_exit=False)
    supervisor.server = server
    app = FastAPI()
    runtime.attach(app, server, supervisor)

    async def scenario() -> List[str]:
        manager.loop = asyncio.get_running_loop()
        async with app.router.lifespan_context(app):
            await until(lambda: runtime.client is not None and runtime.client.registered, "the node to register")
            assert not master.bodies[HEARTBEAT_PATH]
            order: List[str] = []
            manager.refuse_new_requests = lambda message, code: order.append(
                f"refuse_new_requests (service {runtime.service.state})")
            supervisor.stop_signal(signal.SIGTERM)
            await until(lambda: bool(master.bodies[HEARTBEAT_PATH]), "the draining heartbeat")
            await until(lambda: server.should_exit, "the drain to end the server")
            return order

    try:
        order = asyncio.run(asyncio.wait_for(scenario(), 60))
    finally:
        master.stop()
    beat = master.bodies[HEARTBEAT_PATH][0]
    assert beat[STATE_KEY] == "draining" and beat["load"]["running_requests"] == 0
    # The service was draining before the manager began refusing: a PD request never sees the
    # manager's shutdown error where a busy answer belongs.
    assert order == ["refuse_new_requests (service draining)"]
    assert "wait_until_idle" in manager.calls and "fail_pending" not in manager.calls
    # Stopped for good, the drained node deregistered (the master drops it at once, not after
    # its silence bound).
    assert master.bodies[DEREGISTER_PATH] == [{"node_id": "d0"}]


def test_stop_listeners_run_once_and_also_when_the_stop_is_immediate() -> None:
    manager = DrainingManager()
    heard: List[str] = []

    async def scenario(graceful: float) -> None:
        manager.loop = asyncio.get_running_loop()
        supervisor = Supervisor(manager, graceful_shutdown_seconds=graceful)
        supervisor.server = types.SimpleNamespace(should_exit=False)
        supervisor.add_stop_listener(lambda: heard.append(f"graceful={graceful:g}"))
        supervisor.add_stop_listener(lambda: 1 / 0)  # a broken listener stops nothing
        supervisor.stop_signal(signal.SIGTERM)
        supervisor.stop_signal(signal.SIGTERM)
        await until(lambda: supervisor.server.should_exit, "the server to stop")

    asyncio.run(asyncio.wait_for(scenario(5), 60))
    asyncio.run(asyncio.wait_for(scenario(0), 60))
    assert heard == ["graceful=5", "graceful=0"]
