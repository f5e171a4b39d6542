"""A PD node holds one KV transfer pair per connected peer, each named by the master's epoch.

The service under test is the real :class:`PdNodeService` with a real zmq socket standing in
for model rank 0's inbox (the test reads the setups and teardowns off it and answers with
rank 0's messages); the request manager behind it is a scripted host whose requests run until
the test feeds them their events.  The endpoint's cluster-key guard is checked on the real
``create_app``.
"""

from __future__ import annotations

import asyncio
import logging
from typing import Any, Dict, List, Optional, Tuple

import pytest
import zmq
from fastapi.testclient import TestClient
from prometheus_client import CollectorRegistry

from api_fakes import FakeManager, assert_error
from lightllm.common.sampling import SamplingParams
from lightllm.server.core.objs.io_messages import (
    PdChannelBroken,
    PdSetupDone,
    PdTransferSetup,
    PdTransferTeardown,
)
from lightllm.server.core.objs.request_spec import RequestSpec
from lightllm.server.core.objs.shm_req_layout import PD_KIND_DECODE, PD_KIND_PREFILL
from lightllm.server.http.app import create_app
from lightllm.server.http.server_options import AuthPolicy, HttpServerOptions
from lightllm.server.pd.node.api import pd_node_router
from lightllm.server.pd.node.service import PdNodeService
from lightllm.server.pd.protocol.membership import TRANSFER_TEARDOWN_PATH
from lightllm.server.request_manager import GenerationEvent


def token(request_id: int, token_id: int, finish: Optional[str] = None) -> GenerationEvent:
    return GenerationEvent(request_id, token_id, f"t{token_id}", -0.5, finish, 3, 0, 1)


class ScriptedHost:
    """The service's view of the request manager: each request yields what the test feeds it."""

    vocab_size = 100
    max_req_total_len = 64

    def __init__(self) -> None:
        self.metrics = type("Metrics", (), {"measured": CollectorRegistry()})()
        self.handler: Any = None
        self.submitted: List[Tuple[int, RequestSpec]] = []
        self.closed: List[int] = []
        self.feeds: Dict[int, "asyncio.Queue[Any]"] = {}

    def add_inbox_handler(self, message_types: Tuple[type, ...], handler: Any) -> None:
        self.handler = handler

    def post(self, request_id: int, item: Any) -> bool:
        return False

    async def wait_request_id_free(self, request_id: int, timeout: float) -> bool:
        return True

    async def generate(self, spec: RequestSpec, *, request: Any = None, request_id: Optional[int] = None,
                       slot_wait_seconds: Optional[float] = None, drain_exempt: bool = False):
        assert request_id is not None
        self.submitted.append((request_id, spec))
        feed = self.feeds.setdefault(request_id, asyncio.Queue())
        try:
            while True:
                item = await feed.get()
                if item is None:
                    return
                yield item
        finally:
            self.closed.append(request_id)

    def feed(self, request_id: int, *items: Any) -> None:
        queue = self.feeds.setdefault(request_id, asyncio.Queue())
        for item in items:
            queue.put_nowait(item)


def spec(kind: int = PD_KIND_DECODE) -> RequestSpec:
    return RequestSpec.build([1, 2, 3, 4], SamplingParams(temperature=0, max_new_tokens=4), pd_kind=kind)


class Rank0:
    """Model rank 0's inbox: what the service sent, and rank 0's answers (through the host's handler)."""

    def __init__(self, tmp_path: Any) -> None:
        self.address = f"ipc://{tmp_path}/rank0.sock"
        self._ctx = zmq.Context()
        self._socket = self._ctx.socket(zmq.PULL)
        self._socket.bind(self.address)

    async def receive(self) -> Any:
        for _ in range(1000):
            if self._socket.poll(0):
                return self._socket.recv_pyobj()
            await asyncio.sleep(0.01)
        raise AssertionError("nothing reached model rank 0")

    def pending(self) -> bool:
        return bool(self._socket.poll(0))

    def close(self) -> None:
        self._ctx.destroy(linger=0)


@pytest.fixture
def rank0(tmp_path):
    inbox = Rank0(tmp_path)
    yield inbox
    inbox.close()


async def set_up(service: PdNodeService, host: ScriptedHost, rank0: Rank0, epoch: int, peer: str) -> PdTransferSetup:
    """One transfer setup that rank 0 confirms; returns the command rank 0 received."""
    setup = asyncio.create_task(service.transfer_setup(epoch, peer))
    command = await rank0.receive()
    host.handler(PdSetupDone(epoch, setup_id=command.setup_id))
    await setup
    return command


async def first_events(service: PdNodeService, request_id: int, epoch: int, count: int, kind: int = PD_KIND_DECODE
                       ) -> List[Any]:
    events: List[Any] = []
    async for event in service.generate(spec(kind), request_id=request_id, epoch=epoch):
        events.append(event)
        if len(events) == count:
            break
    return events


def test_two_peers_are_set_up_side_by_side_and_requests_run_under_their_own_epoch(rank0) -> None:
    host = ScriptedHost()
    service = PdNodeService(host, "decode", 5.0, rank0.address)

    async def scenario() -> Dict[str, Any]:
        service.start()
        try:
            first = await set_up(service, host, rank0, 7, "10.0.0.1:7000")
            second = await set_up(service, host, rank0, 8, "10.0.0.2:7100")
            host.feed(1, token(1, 11, "length"))
            host.feed(2, token(2, 12, "length"))
            one = await first_events(service, 1, 7, 1)
            two = await first_events(service, 2, 8, 1)
            return {"commands": [first, second], "epochs": dict(service.epochs), "events": one + two}
        finally:
            service.stop()

    result = asyncio.run(scenario())
    assert [(c.epoch, c.peer_host, c.peer_port) for c in result["commands"]] == [(7, "10.0.0.1", 7000),
                                                                                (8, "10.0.0.2", 7100)]
    assert result["epochs"] == {7: None, 8: None}  # the second setup left the first pair alone
    assert [(request_id, s.pd.epoch) for request_id, s in host.submitted] == [(1, 7), (2, 8)]
    assert [event.token.token_id for event in result["events"]] == [11, 12]


def test_a_decode_node_sends_its_ranks_the_bare_ipv6_host(rank0) -> None:
    """The setup command carries the prefill node's host as a socket takes it: the ranks connect to
    ``fd00::7`` (``"[fd00::7]"`` resolves to nothing, and the join timed out)."""
    host = ScriptedHost()
    service = PdNodeService(host, "decode", 5.0, rank0.address)

    async def scenario() -> PdTransferSetup:
        service.start()
        try:
            return await set_up(service, host, rank0, 3, "[fd00::7]:7000")
        finally:
            service.stop()

    command = asyncio.run(scenario())
    assert (command.peer_host, command.peer_port) == ("fd00::7", 7000)

def test_a_broken_pair_refuses_only_its_own_requests() -> None:
    host = ScriptedHost()
    service = PdNodeService(host, "prefill", 5.0, "ipc:///unused")
    service.epochs.update({3: None, 4: None})
    host.handler(PdChannelBroken(3, "peer d1 gone"))
    host.handler(PdChannelBroken(99, "a pair this node never had"))
    assert service.epochs == {3: "peer d1 gone", 4: None}
    assert service.usable_epochs() == [4]

    async def scenario() -> Tuple[List[Any], List[Any], List[Any]]:
        broken = await first_events(service, 1, 3, 1, PD_KIND_PREFILL)
        unknown = await first_events(service, 2, 5, 1, PD_KIND_PREFILL)
        host.feed(3, token(3, 9))
        live = await first_events(service, 3, 4, 1, PD_KIND_PREFILL)
        return broken, unknown, live

    broken, unknown, live = asyncio.run(scenario())
    assert (broken[0].kind, broken[0].error_kind, broken[0].transfer_broken) == ("error", "transfer_broken", True)
    assert "peer d1 gone" in broken[0].message
    assert (unknown[0].kind, unknown[0].error_kind, unknown[0].transfer_broken) == ("error", "epoch", True)
    assert "epoch 5" in unknown[0].message and "[4]" in unknown[0].message
    assert live[0].kind == "token"
    assert [(request_id, s.pd.epoch) for request_id, s in host.submitted] == [(3, 4)]  # only the live pair's


def test_teardown_drops_one_pair_tells_rank0_and_is_idempotent(rank0) -> None:
    host = ScriptedHost()
    service = PdNodeService(host, "decode", 5.0, rank0.address)

    async def scenario() -> Dict[str, Any]:
        service.start()
        try:
            await set_up(service, host, rank0, 1, "10.0.0.1:7000")
            await set_up(service, host, rank0, 2, "10.0.0.2:7000")
            known = await service.transfer_teardown(1)
            sent = await rank0.receive()
            again = await service.transfer_teardown(1)
            sent_again = await rank0.receive()
            events = await first_events(service, 5, 1, 1)
            return {"known": known, "again": again, "sent": [sent, sent_again], "epochs": dict(service.epochs),
                    "events": events}
        finally:
            service.stop()

    result = asyncio.run(scenario())
    assert (result["known"], result["again"]) == (True, False)
    # Rank 0 hears of it both times: a setup this process gave up on may have finished there.
    assert result["sent"] == [PdTransferTeardown(1), PdTransferTeardown(1)]
    assert result["epochs"] == {2: None}
    assert result["events"][0].error_kind == "epoch" and host.submitted == []


def test_a_master_that_forgot_the_node_gets_every_pair_torn_down(rank0) -> None:
    """Its pairs were torn down on their peers when the master dropped the node (say it hung):
    what they still hold here (transfer processes, reservations) goes at once, not at the leases."""
    host = ScriptedHost()
    service = PdNodeService(host, "decode", 5.0, rank0.address)

    async def scenario() -> Dict[str, Any]:
        service.start()
        try:
            await set_up(service, host, rank0, 4, "10.0.0.1:7000")
            await set_up(service, host, rank0, 6, "10.0.0.2:7000")
            dropped = await service.teardown_all()
            sent = [await rank0.receive(), await rank0.receive()]
            return {"dropped": dropped, "sent": sent, "epochs": dict(service.epochs), "more": rank0.pending()}
        finally:
            service.stop()

    result = asyncio.run(scenario())
    assert result["dropped"] == [4, 6]
    assert result["sent"] == [PdTransferTeardown(4), PdTransferTeardown(6)]
    assert result["epochs"] == {} and not result["more"]


def test_a_teardown_during_a_setup_fails_that_setup(rank0) -> None:
    host = ScriptedHost()
    service = PdNodeService(host, "prefill", 5.0, rank0.address)

    async def scenario() -> Tuple[bool, Any, Dict[int, Optional[str]]]:
        service.start()
        try:
            setup = asyncio.create_task(service.transfer_setup(6, ""))
            assert isinstance(await rank0.receive(), PdTransferSetup)
            known = await service.transfer_teardown(6)
            with pytest.raises(RuntimeError, match="torn down"):
                await setup
            host.handler(PdSetupDone(6))  # rank 0's late answer changes nothing
            return known, await rank0.receive(), dict(service.epochs)
        finally:
            service.stop()

    known, sent, epochs = asyncio.run(scenario())
    assert known is True and sent == PdTransferTeardown(6) and epochs == {}


def test_a_setup_without_an_answer_is_torn_down_on_rank0(rank0) -> None:
    host = ScriptedHost()
    service = PdNodeService(host, "prefill", 0.2, rank0.address)

    async def scenario() -> List[Any]:
        service.start()
        try:
            with pytest.raises(RuntimeError, match="no answer"):
                await service.transfer_setup(9, "")
            return [await rank0.receive(), await rank0.receive()]
        finally:
            service.stop()

    setup, teardown = asyncio.run(scenario())
    assert (setup.epoch, setup.peer_host, teardown) == (9, "", PdTransferTeardown(9))
    assert service.epochs == {}


def test_a_late_answer_to_a_given_up_setup_does_not_complete_a_later_setup_of_its_epoch(rank0, caplog) -> None:
    """The first setup of epoch 5 times out (torn down on rank 0); a second setup of epoch 5 follows
    (a restarted master numbers its epochs from 0 again).  Rank 0's late answer to the first, a
    failure here, must neither fail nor complete the second: only the second's own answer does."""
    host = ScriptedHost()
    service = PdNodeService(host, "decode", 0.3, rank0.address)

    async def scenario() -> Dict[str, Any]:
        service.start()
        try:
            with pytest.raises(RuntimeError, match="no answer"):
                await service.transfer_setup(5, "10.0.0.1:7000")
            first, teardown = await rank0.receive(), await rank0.receive()
            service.setup_timeout_seconds = 5.0
            later = asyncio.create_task(service.transfer_setup(5, "10.0.0.2:7000"))
            second = await rank0.receive()
            with caplog.at_level(logging.DEBUG, logger="lightllm.server.pd.node.service"):
                host.handler(PdSetupDone(5, "KV transfer setup failed on rank 0: old peer gone", first.setup_id))
            await asyncio.sleep(0.05)
            waited_past_the_stale_answer = not later.done()
            host.handler(PdSetupDone(5, "", second.setup_id))
            await later
            return {"first": first, "teardown": teardown, "second": second, "epochs": dict(service.epochs),
                    "waited": waited_past_the_stale_answer}
        finally:
            service.stop()

    result = asyncio.run(scenario())
    assert result["teardown"] == PdTransferTeardown(5)
    assert result["first"].setup_id != result["second"].setup_id
    assert result["waited"]  # the stale answer resolved nothing
    assert result["epochs"] == {5: None}  # set up by its own answer, not failed by the stale one
    assert f"dropped rank 0's answer to KV transfer setup {result['first'].setup_id} of epoch 5" in caplog.text


def test_an_answer_to_no_setup_is_dropped(rank0) -> None:
    """Rank 0's answer naming an attempt this process never made (or an id-less one) changes nothing."""
    host = ScriptedHost()
    service = PdNodeService(host, "prefill", 5.0, rank0.address)

    async def scenario() -> Dict[int, Optional[str]]:
        service.start()
        try:
            setup = asyncio.create_task(service.transfer_setup(2, ""))
            command = await rank0.receive()
            host.handler(PdSetupDone(2))  # no id
            host.handler(PdSetupDone(2, "", command.setup_id + 1))  # another attempt's
            host.handler(PdSetupDone(3, "", command.setup_id))  # another epoch's
            await asyncio.sleep(0.05)
            assert not setup.done()
            host.handler(PdSetupDone(2, "", command.setup_id))
            await setup
            return dict(service.epochs)
        finally:
            service.stop()

    assert asyncio.run(scenario()) == {2: None}


@pytest.mark.parametrize("epoch", [-1, True, 2**31, "3"])
def test_setup_and_teardown_refuse_an_epoch_a_request_cannot_carry(epoch: Any) -> None:
    service = PdNodeService(ScriptedHost(), "prefill", 1.0, "ipc:///unused")
    with pytest.raises(ValueError, match="epoch"):
        asyncio.run(service.transfer_setup(epoch, ""))
    with pytest.raises(ValueError, match="epoch"):
        asyncio.run(service.transfer_teardown(epoch))


class TeardownOnly:
    """Just enough of a node service for the router; records teardowns."""

    vocab_size = 100
    max_req_total_len = 64

    def __init__(self) -> None:
        self.metrics_registry = CollectorRegistry()
        self.torn_down: List[int] = []

    async def transfer_teardown(self, epoch: int) -> bool:
        self.torn_down.append(epoch)
        return epoch == 4


def test_the_teardown_endpoint_takes_only_the_cluster_key() -> None:
    service = TeardownOnly()
    policy = AuthPolicy(api_keys=("user-key",), cluster_key="cluster-key")
    app = create_app(FakeManager(), HttpServerOptions(auth=policy), extra_routers=[pd_node_router(service, "decode")])

    def post(key: Optional[str], epoch: int) -> Any:
        headers = {"authorization": f"Bearer {key}"} if key else {}
        return TestClient(app, headers=headers, raise_server_exceptions=False).post(
            TRANSFER_TEARDOWN_PATH, json={"epoch": epoch})

    assert_error(post(None, 4), 401, code="missing_cluster_key")
    assert_error(post("user-key", 4), 401, code="invalid_cluster_key")
    assert service.torn_down == []
    assert post("cluster-key", 4).json() == {"epoch": 4, "known": True}
    assert post("cluster-key", 4).json() == {"epoch": 4, "known": True}
    assert post("cluster-key", 5).json() == {"epoch": 5, "known": False}
    assert service.torn_down == [4, 4, 5]
