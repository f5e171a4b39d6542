"""Prefill/decode node stand-ins that speak the PD node contract, for the PD master's tests.

The stand-ins are small FastAPI apps served by uvicorn on loopback
(:class:`~uvicorn_in_thread.ThreadServer`) that register and heartbeat with the real
:class:`PdNodeClient` and answer ``/pd/node/transfer_setup``, ``/pd/node/decode`` and
``/pd/node/prefill`` with the contract's NDJSON lines.  They "generate" with a deterministic function of the whole sequence
(:func:`next_token`), so a request split into continuation segments must give exactly the tokens
of :func:`reference_tokens`; the "KV transfer" is P handing its first token to D through a
thread-safe :class:`Handoff`.  Their knobs (busy, a limit of held reservations, a per-segment
token limit, going silent, a broken transfer) are attributes the tests set.  A stand-in keeps
one transfer epoch per peer, as a real node does, and records the ``transfer_teardown`` calls it
gets; :meth:`NodeStandIn.report` sends the master a heartbeat with a load and state of the
test's choice (the stand-ins' periodic heartbeats carry none, so the master's view of a node's
load changes only when a test says so).
"""

from __future__ import annotations

import asyncio
import json
import threading
import time
from typing import Any, Dict, List, Optional, Tuple

import httpx
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse

from lightllm.server.pd.node.registration_client import PdNodeClient
from lightllm.server.pd.protocol.node_info import NodeInfo
from uvicorn_in_thread import ThreadServer

HEARTBEAT_S = 0.5
# Generous: a loaded machine can be slow to answer, and every test bounds its own waits.
REQUEST_TIMEOUT = httpx.Timeout(30.0)


def next_token(sequence: List[int]) -> int:
    """The stand-ins' "model": the next token is a fixed function of the whole sequence."""
    return (sum(sequence) * 31 + len(sequence) * 7) % 97 + 3


def reference_tokens(prompt: List[int], max_new_tokens: int) -> List[int]:
    """The tokens an unsplit generation gives (greedy, no stop)."""
    sequence, out = list(prompt), []
    for _ in range(max_new_tokens):
        token = next_token(sequence)
        sequence.append(token)
        out.append(token)
    return out


class Handoff:
    """P's first token per (request id, segment) and D's acknowledgement (the stand-in KV transfer)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._first: Dict[Tuple[int, int], int] = {}
        self._acked: set = set()

    def put(self, key: Tuple[int, int], token: int) -> None:
        with self._lock:
            self._first[key] = token

    async def take(self, key: Tuple[int, int], timeout: float = 30) -> int:
        deadline = time.monotonic() + timeout
        while True:
            with self._lock:
                if key in self._first:
                    self._acked.add(key)
                    return self._first[key]
            assert time.monotonic() < deadline, f"no hand-off for {key}"
            await asyncio.sleep(0.005)

    async def wait_ack(self, key: Tuple[int, int], timeout: float = 30) -> None:
        deadline = time.monotonic() + timeout
        while True:
            with self._lock:
                if key in self._acked:
                    return
            assert time.monotonic() < deadline, f"no acknowledgement for {key}"
            await asyncio.sleep(0.005)


def _line(fields: Dict[str, Any]) -> bytes:
    return json.dumps(fields).encode() + b"\n"


def _token(token_id: int, finish: Optional[str] = None, cached: int = 0, **extra: Any) -> bytes:
    return _line({"event": "token", "token_id": token_id, "text": f" t{token_id}", "logprob": -0.5,
                  "top_logprobs": None, "finish_reason": finish, "cached_tokens": cached, **extra})


class NodeStandIn:
    """A prefill or decode node stand-in, registered with the master at ``master_url``."""

    def __init__(self, role: str, master_url: str, handoff: Handoff, model_name: str, node_id: Optional[str] = None,
                 tp_size: int = 1) -> None:
        self.role = role
        self.handoff = handoff
        self.master_url = master_url
        self.epochs: set = set()  # the transfer epochs set up and not torn down (one per peer)
        self.busy = False
        self.busy_from_segment: Optional[int] = None  # busy for segments with at least this index
        self.busy_message = "no KV free"  # the message of a busy answer (a real node names the limit hit)
        self.segment_limit: Optional[int] = None  # D: tokens after the echo before segment_end
        self.segment_end_reason = "segment_limit"  # D: the reason of that segment_end
        self.token_delay = 0.0
        self.silent_after: Optional[int] = None  # D: hang after this many tokens of a segment
        self.hold_after: Optional[int] = None  # D: pause after this many tokens until release_hold()
        self._released = threading.Event()
        self.request_slots: Optional[int] = None  # reported at registration (a real node's slot count)
        self.top_logprob_slots: Optional[int] = None  # the same for its top-logprob rows
        # D: while cleared, a reservation waits before answering "reserved" (a decode node slow to reserve),
        # from the request body with this number on (1: every one)
        self.reservations_open = threading.Event()
        self.reservations_open.set()
        self.hold_reservations_from = 1
        # D: answer busy while this many reservations are held (None: no limit), as a real decode
        # node whose KV holds that many requests; a reservation is held while its stream is open.
        self.max_reservations: Optional[int] = None
        self.open_reservations = 0
        self._stopped = False
        self.cached_tokens = 3
        self.fail_transfer = False  # P: an error line (transfer_broken) after the first token
        # P: the error_kind of a request that ends alone in the rank ("generation_failed", "grammar_failed")
        self.fail_generation = ""
        self.prefill_delay = 0.0  # P: seconds before the first token
        self.first_line_delay = 0.0  # P: seconds between handing the token to D and sending its line
        self.refuse_setup = False  # answer transfer_setup with a 500
        self.failed = False  # answer every request 503 server_failed (its model process died)
        self.setup_delay = 0.0  # seconds before answering transfer_setup (a node that is up but slow)
        self.lease_expires = False  # D: an error line (lease expired) right after reserving
        # P: after D took the first token, wait for cut_stream() and then break the stream
        # without its handed_off line (a node that dies before its last line leaves).
        self.cut_before_handed_off = False
        self._cut = threading.Event()
        self.stream_cut = threading.Event()  # set once such a stream was broken
        self.setups: List[Dict[str, Any]] = []
        self.teardowns: List[int] = []  # epochs of the transfer_teardown calls, in order
        self.bodies: List[Dict[str, Any]] = []
        self.finished: List[int] = []
        self.aborted: List[int] = []
        self.aborted_segments: List[Tuple[int, int]] = []  # (request_id, segment_index) of closed streams
        self.client: Optional[PdNodeClient] = None
        self._node_id = node_id or f"{role}-standin"
        self._model_name = model_name
        self._tp_size = tp_size
        self.server = ThreadServer(self._app())

    @property
    def node_id(self) -> str:
        return self._node_id

    @property
    def epoch(self) -> Optional[int]:
        """The latest transfer epoch still set up (None: none)."""
        return max(self.epochs) if self.epochs else None

    @epoch.setter
    def epoch(self, value: Optional[int]) -> None:
        # None: the node lost every transfer handle (a test breaks its transfers).
        self.epochs = set() if value is None else {value}

    def report(self, load: Optional[Dict[str, Any]] = None, state: Optional[str] = None) -> None:
        """Send the master one heartbeat carrying ``load`` and/or ``state`` (returns once it answered)."""
        body: Dict[str, Any] = {"node_id": self._node_id}
        if load is not None:
            body["load"] = load
        if state is not None:
            body["state"] = state
        response = httpx.post(f"{self.master_url}/pd/heartbeat", json=body, timeout=REQUEST_TIMEOUT)
        assert response.status_code == 200, response.text

    def _is_busy(self, body: Dict[str, Any]) -> bool:
        return self.busy or (self.busy_from_segment is not None and body["segment_index"] >= self.busy_from_segment)

    def info(self) -> NodeInfo:
        return NodeInfo(node_id=self._node_id, role=self.role, model_name=self._model_name, dtype="float32",
                        num_layers=2, num_kv_heads=2, head_dim=16, tp_size=self._tp_size,
                        http_address=f"127.0.0.1:{self.server.port}",
                        kv_transfer_address=(f"127.0.0.1:{self.server.port % 65535 + 1}" if self.role == "prefill"
                                             else ""), request_slots=self.request_slots,
                        top_logprob_slots=self.top_logprob_slots)

    def register(self) -> None:
        """Start registering and heartbeating (returns once registered)."""

        async def start() -> None:
            self.client = PdNodeClient(self.master_url, self.info(), heartbeat_interval_s=HEARTBEAT_S)
            self.client.start()
            await self.client.wait_registered(10)

        self.server.call(start())

    def go_silent(self) -> None:
        """Stop heartbeating and answering (a hung or killed node, as the master sees it)."""
        if self.client is not None:
            self.server.call(self.client.stop())
            self.client = None
        self.silent_after = 0

    def cut_stream(self) -> None:
        """Break the prefill stream held by ``cut_before_handed_off``."""
        self._cut.set()

    def release_hold(self) -> None:
        """Let a decode stream paused by ``hold_after`` go on."""
        self._released.set()

    def stop(self) -> None:
        """Stop heartbeating and serving (its port then refuses connections, as a killed node's
        does); a second call does nothing."""
        self._released.set()
        self.reservations_open.set()
        client, self.client = self.client, None
        if client is not None:
            try:
                self.server.call(client.stop())
            except Exception:  # noqa: BLE001 - the server thread may already be gone
                pass
        if not self._stopped:
            self._stopped = True
            self.server.stop()

    def _app(self) -> FastAPI:
        app = FastAPI()

        @app.post("/pd/node/transfer_setup")
        async def transfer_setup(request: Request) -> JSONResponse:
            body = await request.json()
            self.setups.append(body)
            await asyncio.sleep(self.setup_delay)
            if self.refuse_setup:
                return JSONResponse({"error": {"message": "rank 0 could not start its transfer handle",
                                               "type": "server_error", "param": None, "code": None}}, 500)
            self.epochs.add(body["epoch"])
            return JSONResponse({"epoch": body["epoch"]})

        @app.post("/pd/node/transfer_teardown")
        async def transfer_teardown(request: Request) -> JSONResponse:
            epoch = (await request.json())["epoch"]
            self.teardowns.append(epoch)
            known = epoch in self.epochs
            self.epochs.discard(epoch)
            return JSONResponse({"epoch": epoch, "known": known})

        path = "/pd/node/decode" if self.role == "decode" else "/pd/node/prefill"

        @app.post(path)
        async def generate(request: Request) -> Response:
            body = await request.json()
            self.bodies.append(body)
            if self.failed:
                # What a real node's supervisor answers once a child process died.
                return JSONResponse({"error": {"message": "The server failed: child process model_rank0 exited; the "
                                               "request was not completed, retry it on another server",
                                               "type": "server_error", "param": None, "code": "server_failed"}},
                                    status_code=503)
            lines = self._decode(body) if self.role == "decode" else self._prefill(body)
            return StreamingResponse(self._tracked(body["request_id"], lines, body["segment_index"]),
                                     media_type="application/x-ndjson")

        return app

    async def _tracked(self, request_id: int, lines: Any, segment_index: int):
        done = False
        try:
            async for line in lines:
                yield line
            done = True
        finally:
            (self.finished if done else self.aborted).append(request_id)
            if not done:
                self.aborted_segments.append((request_id, segment_index))

    def _refusal(self, body: Dict[str, Any], busy_message: str) -> Optional[bytes]:
        """The line a node answers instead of serving: no transfer for the epoch, or busy."""
        if body["epoch"] not in self.epochs:
            return _line({"event": "error", "message": f"transfer not set up for epoch {body['epoch']}",
                          "transfer_broken": True})
        if self._is_busy(body):
            return _line({"event": "busy", "message": busy_message})
        return None

    async def _prefill(self, body: Dict[str, Any]):
        refusal = self._refusal(body, "prefill queue full")
        if refusal is not None:
            yield refusal
            return
        prompt, max_new = body["prompt_ids"], body["params"]["max_new_tokens"]
        await asyncio.sleep(self.prefill_delay)
        first = next_token(prompt)
        if max_new == 1 or first in body["params"].get("stop_token_ids", []):
            # The first token ends the request here (nothing moves to D), as a real node's rank
            # finishes it on the length or on a stop token.
            finish = "length" if max_new == 1 else "stop"
            yield _token(first, finish, self.cached_tokens, prompt_logprobs=None)
            return
        key = (body["request_id"], body["segment_index"])
        if self.fail_generation:
            # As a real node words a request its rank ended with an error (or whose grammar could not go on).
            yield _line({"event": "error", "error_kind": self.fail_generation,
                         "message": f"request {body['request_id']} failed on the node while generating"})
            return
        if self.fail_transfer:
            yield _token(first, None, self.cached_tokens, prompt_logprobs=None)
            self.epoch = None  # its transfer group is gone until the next setup
            yield _line({"event": "error", "message": "KV transfer failed: checksum mismatch", "transfer_broken": True})
            return
        self.handoff.put(key, first)
        await asyncio.sleep(self.first_line_delay)
        yield _token(first, None, self.cached_tokens, prompt_logprobs=None)
        await self.handoff.wait_ack(key)
        if self.cut_before_handed_off:
            while not self._cut.is_set():
                await asyncio.sleep(0.01)
            self.stream_cut.set()
            raise ConnectionAbortedError("the prefill stand-in breaks its stream before handed_off")
        yield _line({"event": "handed_off"})

    async def _decode(self, body: Dict[str, Any]):
        refusal = self._refusal(body, self.busy_message)
        full = self.max_reservations is not None and self.open_reservations >= self.max_reservations
        if refusal is None and full:
            refusal = _line({"event": "busy", "message": f"no KV: {self.open_reservations} reservation(s) held"})
        if refusal is not None:
            yield refusal
            return
        # Held until the stream ends, by itself or because the master closed it (its finally).
        self.open_reservations += 1
        try:
            async for line in self._decode_reserved(body):
                yield line
        finally:
            self.open_reservations -= 1

    async def _decode_reserved(self, body: Dict[str, Any]):
        while len(self.bodies) >= self.hold_reservations_from and not self.reservations_open.is_set():
            await asyncio.sleep(0.005)
        yield _line({"event": "reserved", "kv_start": 0})
        if self.lease_expires:
            await asyncio.sleep(0.1)
            # As a real decode node words it (pd_transfer: error_kind lease_expired).
            yield _line({"event": "error", "message": "the KV did not arrive within the lease", "transfer_broken": False,
                         "error_kind": "lease_expired"})
            return
        first = await self.handoff.take((body["request_id"], body["segment_index"]))
        yield _token(first)  # the echo of P's first token
        sequence = body["prompt_ids"] + [first]
        max_new, produced, after_echo = body["params"]["max_new_tokens"], 1, 0
        while produced < max_new:
            if self.segment_limit is not None and after_echo >= self.segment_limit:
                yield _line({"event": "segment_end", "reason": self.segment_end_reason})
                return
            if self.silent_after is not None and after_echo >= self.silent_after:
                await asyncio.sleep(3600)
            if self.hold_after is not None and after_echo >= self.hold_after:
                while not self._released.is_set():
                    await asyncio.sleep(0.01)
            await asyncio.sleep(self.token_delay)
            token = next_token(sequence)
            sequence.append(token)
            produced += 1
            after_echo += 1
            yield _token(token, "length" if produced == max_new else None)
