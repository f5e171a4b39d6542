"""PD membership over real HTTP on loopback: a uvicorn master and node clients heartbeating it.

The master here is only the membership part (the registration router, the readiness probe and
the expiry sweeper) with a short heartbeat interval, so drops happen within a second.
"""

from __future__ import annotations

import asyncio
import logging
import re
import socket
import threading
import time
from contextlib import asynccontextmanager
from typing import Any, List, Optional, Tuple

import httpx
import pytest
import uvicorn
from fastapi import FastAPI

from canned_server import serve
from pd_membership_support import node
from lightllm.server.http.errors import install_error_handlers
from lightllm.server.pd.master.expiry_sweeper import ExpirySweeper
from lightllm.server.pd.master.membership_api import (
    membership_router,
    new_master_id,
    readiness_router,
)
from lightllm.server.pd.node.registration_client import NodeRegistrationRefused, PdNodeClient
from lightllm.server.pd.master.node_registry import NodeRegistry

INTERVAL_S = 0.2
MISSED = 3
# The documented bound: expiry (interval x missed) plus one sweep period (half an interval).
DROP_BOUND_S = INTERVAL_S * (MISSED + 0.5)


class Master:
    """A membership-only PD master served by uvicorn in a thread (a fresh registry per start)."""

    def __init__(self, interval_s: float = INTERVAL_S) -> None:
        self.interval_s = interval_s
        self.port: Optional[int] = None
        self.dropped: List[Tuple[str, str, float]] = []
        self._server: Optional[uvicorn.Server] = None
        self._thread: Optional[threading.Thread] = None
        self._sock: Optional[socket.socket] = None

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def start(self) -> None:
        registry = NodeRegistry(heartbeat_interval_s=self.interval_s, max_missed_heartbeats=MISSED)
        registry.add_drop_listener(lambda info, reason: self.dropped.append((info.node_id, reason, time.monotonic())))
        sweeper = ExpirySweeper(registry)

        @asynccontextmanager
        async def lifespan(app: FastAPI):
            sweeper.start()
            yield
            await sweeper.stop()

        app = FastAPI(lifespan=lifespan)
        install_error_handlers(app)
        app.include_router(membership_router(registry, new_master_id()))
        app.include_router(readiness_router(registry))
        sock = socket.socket()
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind(("127.0.0.1", self.port or 0))
        self.port = sock.getsockname()[1]
        self._sock = sock
        self._server = uvicorn.Server(uvicorn.Config(app, log_level="warning"))
        self._thread = threading.Thread(target=self._server.run, kwargs={"sockets": [sock]}, daemon=True)
        self._thread.start()
        deadline = time.monotonic() + 20
        while not self._server.started:
            assert self._thread.is_alive() and time.monotonic() < deadline, "master did not start"
            time.sleep(0.01)

    def stop(self) -> None:
        if self._server is not None:
            self._server.should_exit = True
            self._thread.join(timeout=10)
            self._sock.close()
            self._server = None


@pytest.fixture()
def master():
    master = Master()
    master.start()
    yield master
    master.stop()


async def _until(predicate, timeout: float, what: str) -> float:
    """Poll ``predicate`` (async) until true; returns the seconds it took."""
    start = time.monotonic()
    while not await predicate():
        assert time.monotonic() - start < timeout, f"timed out waiting for {what}"
        await asyncio.sleep(0.02)
    return time.monotonic() - start


def test_registration_heartbeats_refusal_expiry_and_readiness(master: Master) -> None:
    async def scenario() -> None:
        async with httpx.AsyncClient(base_url=master.url, trust_env=False) as http:

            async def health() -> Tuple[int, Any]:
                response = await http.get("/health")
                return response.status_code, response.json()

            async def node_ids() -> List[str]:
                return [n["node_id"] for n in (await http.get("/pd/nodes")).json()["nodes"]]

            status, body = await health()
            assert status == 503 and body["error"]["code"] == "pd_not_ready"
            assert body["error"]["message"] == (
                "The PD cluster is not ready: no prefill node registered; no decode node registered"
            )
            assert body["error"]["type"] == "service_unavailable_error"

            prefill = PdNodeClient(master.url, node("p0", "prefill", port=9000), heartbeat_interval_s=0.05)
            prefill.start()
            await prefill.wait_registered(10)
            assert prefill.heartbeat_interval_s == INTERVAL_S  # the master sets the pace
            # Two intervals beyond the master's own bound: a stall of the master's is not the node's reason to give up.
            assert prefill.master_timeout_s == pytest.approx(INTERVAL_S * (MISSED + 2))
            status, body = await health()
            assert status == 503 and body["error"]["message"].endswith(": no decode node registered")

            decode = PdNodeClient(master.url, node("d0", "decode", port=9100))
            decode.start()
            await decode.wait_registered(10)
            assert await health() == (200, {"status": "ok"})

            refused: List[str] = []
            bad = PdNodeClient(master.url, node("d1", "decode", port=9200, tp_size=2, dtype="bfloat16"),
                               on_refused=refused.append)
            bad.start()
            with pytest.raises(NodeRegistrationRefused) as err:
                await bad.wait_registered(10)
            assert err.value.code == "incompatible_node"
            assert "node 'd1' (decode at 127.0.0.1:9200) is incompatible" in str(err.value)
            assert "dtype: 'bfloat16' != 'float32'; tp_size: 2 != 1" in str(err.value)
            assert refused == [str(err.value)]
            await bad.stop()

            # Both good nodes keep beating; the refused one never joined.
            async def beating() -> bool:
                nodes = (await http.get("/pd/nodes")).json()["nodes"]
                return len(nodes) == 2 and all(n["heartbeats"] >= 3 for n in nodes)

            await _until(beating, 10, "three heartbeats from each node")
            assert await node_ids() == ["d0", "p0"]

            # The decode node's heartbeats stop: it is dropped within the documented bound.
            await decode.stop()
            stopped = time.monotonic()

            async def decode_dropped() -> bool:
                return "d0" not in await node_ids()

            await _until(decode_dropped, 10, "the silent decode node to be dropped")
            (node_id, reason, dropped_at), = master.dropped
            assert node_id == "d0" and f"missed {MISSED} heartbeats" in reason
            # Never before the expiry, counted from the last heartbeat the master received (stop()
            # may return well after it on a loaded machine, so `stopped` cannot bound it from below);
            # a generous upper bound from `stopped` (loaded CI machine).
            silence = re.search(r"none for ([0-9.]+) s", reason)
            assert silence is not None, reason
            assert float(silence.group(1)) >= round(INTERVAL_S * MISSED, 1)
            assert dropped_at - stopped <= DROP_BOUND_S + 2.0
            status, body = await health()
            assert status == 503 and body["error"]["message"].endswith(": no decode node registered")
            assert "p0" in await node_ids()  # the prefill node kept beating and stays
            await prefill.stop()

    asyncio.run(scenario())


def test_protocol_errors_use_the_project_error_shape(master: Master) -> None:
    with httpx.Client(base_url=master.url, trust_env=False) as http:
        response = http.post("/pd/register", content=b"not json")
        assert response.status_code == 400 and response.json()["error"]["code"] == "invalid_json"
        body = {**node("p0", "prefill").to_dict(), "dtype": "int4"}
        error = http.post("/pd/register", json=body).json()["error"]
        assert error["param"] == "dtype" and error["code"] == "invalid_node_info"
        assert error["message"] == "dtype must be one of float16, bfloat16, float32, got 'int4'"
        response = http.post("/pd/heartbeat", json={"node_id": "ghost"})
        assert response.status_code == 404
        error = response.json()["error"]
        assert error["code"] == "unknown_node" and "'ghost' is not registered" in error["message"]
        assert http.post("/pd/heartbeat", json={"node_id": "ghost", "load": 3}).json()["error"]["param"] == "load"
        assert http.post("/pd/register", json=node("p0", "prefill").to_dict()).status_code == 200
        response = http.post("/pd/register", json=node("p0", "decode", port=9300).to_dict())
        assert response.status_code == 409 and response.json()["error"]["code"] == "node_id_in_use"


def test_node_notices_a_dead_master_and_registers_again_after_its_restart(master: Master) -> None:
    async def scenario() -> None:
        events: List[str] = []
        reasons: List[str] = []

        def on_master_lost(why: str) -> None:
            events.append("lost")
            reasons.append(why)

        client = PdNodeClient(master.url, node("p0", "prefill"), on_master_lost=on_master_lost,
                              on_master_back=lambda: events.append("back"))
        client.start()
        await client.wait_registered(10)
        first_master = client.master_id
        await asyncio.to_thread(master.stop)
        stopped = time.monotonic()

        async def lost() -> bool:
            return client.master_lost

        await _until(lost, 10 + INTERVAL_S * 2, "the node to notice the dead master")
        # Its bound is two intervals beyond the master's (MASTER_SILENCE_EXTRA_BEATS), counted from
        # the last answer (which may precede `stopped` by more than an interval on a loaded
        # machine, so `stopped` cannot bound it from below); generous upper bound from `stopped`.
        silence = re.search(r"has not answered for ([0-9.]+) s", reasons[0])
        assert silence is not None, reasons[0]
        assert float(silence.group(1)) >= round(INTERVAL_S * (MISSED + 2), 1)
        assert time.monotonic() - stopped <= INTERVAL_S * (MISSED + 2) + 3.0
        assert events == ["lost"] and client.registered  # it still believes it is registered

        await asyncio.to_thread(master.start)  # same port, fresh registry: it does not know p0

        async def back() -> bool:
            return client.registrations == 2 and client.registered

        await _until(back, 10, "the node to register with the restarted master")
        assert events == ["lost", "back"] and not client.master_lost
        assert client.master_id != first_master
        await client.stop()

    asyncio.run(scenario())


def test_heartbeats_and_registrations_carry_load_and_state(master: Master) -> None:
    load = {"queued_prefill_tokens": 120, "running_requests": 2, "free_kv_tokens": 3000, "kv_capacity_tokens": 4096}
    with httpx.Client(base_url=master.url, trust_env=False) as http:
        body = {**node("p0", "prefill").to_dict(), "load": load, "state": "serving"}
        assert http.post("/pd/register", json=body).status_code == 200
        assert http.post("/pd/register", json=node("d0", "decode", port=9100).to_dict()).status_code == 200
        assert http.post("/pd/heartbeat", json={"node_id": "d0"}).status_code == 200  # an older node
        assert http.post("/pd/heartbeat", json={"node_id": "p0", "state": "draining"}).status_code == 200
        nodes = {entry["node_id"]: entry for entry in http.get("/pd/nodes").json()["nodes"]}
        assert (nodes["p0"]["state"], nodes["p0"]["load"]) == ("draining", load)
        assert (nodes["d0"]["state"], nodes["d0"]["load"]) == ("serving", None)
        health = http.get("/health").json()["error"]["message"]
        assert health == "The PD cluster is not ready: every prefill node is draining (p0)"
        for bad, param in [({"load": {"free_kv_tokens": -3}}, "load.free_kv_tokens"), ({"state": "sleeping"}, "state")]:
            response = http.post("/pd/heartbeat", json={"node_id": "d0", **bad})
            assert response.status_code == 400 and response.json()["error"]["param"] == param
            response = http.post("/pd/register", json={**node("d1", "decode", port=9200).to_dict(), **bad})
            assert response.status_code == 400 and response.json()["error"]["param"] == param
        assert [entry["node_id"] for entry in http.get("/pd/nodes").json()["nodes"]] == ["d0", "p0"]


def test_a_drained_node_that_stops_leaves_at_once_and_a_serving_one_by_the_silence_rule() -> None:
    """A cleanly stopped node stayed listed and counted for interval x missed heartbeats (about 6 s).

    The interval here is 60 s, so nothing is dropped by silence while the test runs: a drop can
    only come from the deregistration.
    """
    master = Master(interval_s=60.0)
    master.start()
    states = {"p0": "serving", "d0": "serving"}

    def client(node_id: str, role: str, port: int) -> PdNodeClient:
        return PdNodeClient(master.url, node(node_id, role, port=port), report=lambda: {"state": states[node_id]})

    async def scenario() -> None:
        prefill, decode = client("p0", "prefill", 9000), client("d0", "decode", 9100)
        for each in (prefill, decode):
            each.start()
            await each.wait_registered(10)
        states["d0"] = "draining"
        decode.beat_now()
        async with httpx.AsyncClient(base_url=master.url, trust_env=False) as http:
            async def decode_draining() -> bool:
                nodes = {n["node_id"]: n for n in (await http.get("/pd/nodes")).json()["nodes"]}
                return nodes["d0"]["state"] == "draining"

            await _until(decode_draining, 10, "the decode node's draining heartbeat")
            await decode.stop(leave=True)
            (node_id, reason, _), = master.dropped
            assert node_id == "d0" and "deregistered" in reason
            nodes = (await http.get("/pd/nodes")).json()
            assert [n["node_id"] for n in nodes["nodes"]] == ["p0"]
            assert nodes["missing"] == ["no decode node registered"]

            # Not draining (a node restarted under the same id registers as serving): it stays.
            await prefill.stop(leave=True)
            assert [n["node_id"] for n in (await http.get("/pd/nodes")).json()["nodes"]] == ["p0"]
            assert len(master.dropped) == 1

            # The endpoint itself.
            answer = (await http.post("/pd/deregister", json={"node_id": "p0"})).json()
            assert answer["dropped"] is False and "is serving, not draining" in answer["message"]
            answer = (await http.post("/pd/deregister", json={"node_id": "zz"})).json()
            assert answer == {"node_id": "zz", "dropped": False,
                              "message": "node 'zz' is not registered with this master"}
            for body, param in [({}, "node_id"), ({"node_id": 3}, "node_id"), ({"node_id": "p0", "x": 1}, "x")]:
                response = await http.post("/pd/deregister", json=body)
                assert response.status_code == 400 and response.json()["error"]["param"] == param, response.text

    try:
        asyncio.run(asyncio.wait_for(scenario(), 60))
    finally:
        master.stop()


def test_registering_with_a_server_that_is_no_master_is_refused_saying_so() -> None:
    """A --pd_master_port that points at a node (or anything else) answered "No route POST /pd/register"."""
    app = FastAPI()
    install_error_handlers(app)

    async def scenario(url: str) -> None:
        client = PdNodeClient(url, node("p9", "prefill", port=9300))
        client.start()
        try:
            with pytest.raises(NodeRegistrationRefused) as err:
                await client.wait_registered(10)
        finally:
            await client.stop()
        assert err.value.code == "not_a_pd_master"
        assert str(err.value).startswith(f"{url} is not a PD master") and "--pd_master_port" in str(err.value)

    with serve(app) as url:
        asyncio.run(scenario(url))


def test_a_node_started_before_its_master_waits_for_it_without_calling_it_lost(caplog) -> None:
    """Nothing of a master that never answered can be lost: one warning, no on_master_lost."""
    master = Master()
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        master.port = probe.getsockname()[1]

    async def scenario() -> List[str]:
        events: List[str] = []
        client = PdNodeClient(master.url, node("p0", "prefill"), heartbeat_interval_s=INTERVAL_S,
                              master_timeout_s=0.3, on_master_lost=lambda why: events.append("lost"),
                              on_master_back=lambda: events.append("back"))
        client.start()
        await asyncio.sleep(1.5)  # five master timeouts without an answer
        assert not client.master_lost and not client.registered
        await asyncio.to_thread(master.start)
        try:
            await client.wait_registered(10)
        finally:
            await client.stop()
            await asyncio.to_thread(master.stop)
        return events

    with caplog.at_level(logging.WARNING):
        events = asyncio.run(scenario())
    assert events == []
    waiting = [record for record in caplog.records if "waiting for the PD master" in record.getMessage()]
    assert len(waiting) == 1 and waiting[0].levelno == logging.WARNING
    assert not [record for record in caplog.records if record.levelno >= logging.ERROR]
