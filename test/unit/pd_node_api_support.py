"""The PD node control endpoints served over real HTTP (uvicorn on loopback), with a scripted
node service: what the node API tests share.

The router under test is the real one; the service behind it (standing in for
``PdNodeService``) yields scripted PdNodeEvents and records how its iterators end (an iterator
closed early is how the node aborts a request).
"""

from __future__ import annotations

import asyncio
import json
import socket
import threading
import time
from typing import Any, Dict, List, Optional

import httpx
import pytest
import uvicorn
from fastapi import FastAPI
from prometheus_client import CollectorRegistry

from lightllm.server.core.objs.request_spec import RequestSpec
from lightllm.server.http.errors import install_error_handlers
from lightllm.server.pd.protocol.node_events import PdNodeEvent
from lightllm.server.pd.node.api import pd_node_router, public_api_refusal_router
from lightllm.server.pd.node.open_streams import PdStreams
from lightllm.server.request_manager import GenerationEvent

VOCAB = 100
MAX_LEN = 64


def token(token_id: int, finish: Optional[str] = None, **extra: Any) -> PdNodeEvent:
    event = GenerationEvent(request_id=7, token_id=token_id, text=f"t{token_id}", logprob=-0.25, finish_reason=finish,
                            prompt_tokens=3, cached_tokens=1, completion_tokens=1, **extra)
    return PdNodeEvent(kind="token", token=event)


class ScriptedNodeManager:
    """Yields ``script`` (events, or exceptions to raise) for every generate call."""

    def __init__(self) -> None:
        self.vocab_size = VOCAB
        self.max_req_total_len = MAX_LEN
        self.metrics_registry = CollectorRegistry()
        self.script: List[Any] = []
        # When set, the iterator waits on it after the scripted events (a request still running).
        self.hold = False
        # When set, the iterator ends without an event once the master disconnects.
        self.end_when_master_leaves = False
        self.calls: List[Dict[str, Any]] = []
        self.closed: List[int] = []
        self.setups: List[tuple] = []
        self.teardowns: List[int] = []
        self.setup_failure: Optional[BaseException] = None

    async def transfer_setup(self, epoch: int, prefill_transfer_address: str) -> None:
        if self.setup_failure is not None:
            raise self.setup_failure
        self.setups.append((epoch, prefill_transfer_address))

    async def transfer_teardown(self, epoch: int) -> bool:
        known = any(setup[0] == epoch for setup in self.setups)
        self.setups = [setup for setup in self.setups if setup[0] != epoch]
        self.teardowns.append(epoch)
        return known

    async def generate(self, spec: RequestSpec, *, request_id: int, epoch: int, request: Any = None):
        self.calls.append({"request_id": request_id, "epoch": epoch, "prompt_ids": list(spec.prompt_ids),
                           "params": spec.params, "segment_index": spec.segment.segment_index,
                           "generated_before": spec.segment.generated_before,
                           "high_priority": spec.priority.high_priority_request,
                           "infer_high_priority": spec.priority.infer_high_priority,
                           "pd_kind": spec.pd.kind, "kv_start": spec.pd.kv_start, "lease_s": spec.pd.lease_s})
        try:
            for item in list(self.script):
                if isinstance(item, BaseException):
                    raise item
                yield item
            if self.hold:
                await asyncio.Event().wait()
            while self.end_when_master_leaves and not await request.is_disconnected():
                # As the node's manager ends a request whose master went away: sooner than the
                # API's own first-event poll notices.
                await asyncio.sleep(0.01)
        finally:
            self.closed.append(request_id)


class NodeApp:
    """A decode and a prefill router, each with its own scripted manager, served by uvicorn."""

    def __init__(self) -> None:
        self.decode = ScriptedNodeManager()
        self.prefill = ScriptedNodeManager()
        self.decode_streams = PdStreams()
        decode_app = self._app(self.decode, "decode", self.decode_streams)
        prefill_app = self._app(self.prefill, "prefill", PdStreams())
        self.loops: Dict[str, asyncio.AbstractEventLoop] = {}
        self.decode_url = self._serve(decode_app, "decode")
        self.prefill_url = self._serve(prefill_app, "prefill")

    @staticmethod
    def _app(manager: ScriptedNodeManager, role: str, streams: PdStreams) -> FastAPI:
        app = FastAPI()
        install_error_handlers(app)
        app.include_router(pd_node_router(manager, role, streams))
        app.include_router(public_api_refusal_router(role, "10.0.0.9:1212"))
        return app

    def _serve(self, app: FastAPI, name: str) -> str:
        sock = socket.socket()
        sock.bind(("127.0.0.1", 0))
        server = uvicorn.Server(uvicorn.Config(app, log_level="warning"))

        def run() -> None:
            self.loops[name] = asyncio.new_event_loop()
            asyncio.set_event_loop(self.loops[name])
            self.loops[name].run_until_complete(server.serve(sockets=[sock]))

        thread = threading.Thread(target=run, daemon=True)
        thread.start()
        deadline = time.monotonic() + 20
        while not server.started:
            assert time.monotonic() < deadline
            time.sleep(0.01)
        self.servers = getattr(self, "servers", []) + [(server, thread, sock)]
        return f"http://127.0.0.1:{sock.getsockname()[1]}"

    def stop(self) -> None:
        for server, thread, sock in self.servers:
            server.should_exit = True
            thread.join(timeout=10)
            sock.close()


@pytest.fixture(scope="module")
def node() -> NodeApp:
    app = NodeApp()
    yield app
    app.stop()


def decode_body(**overrides: Any) -> Dict[str, Any]:
    body = {"request_id": 7, "prompt_ids": [1, 5, 9], "params": {"max_new_tokens": 4, "temperature": 0.0},
            "segment_index": 0, "epoch": 3}
    body.update(overrides)
    return body


def prefill_body(**overrides: Any) -> Dict[str, Any]:
    return {**decode_body(), "kv_start": 1, "infer_high_priority": 0, **overrides}


def lines(response: httpx.Response) -> List[Dict[str, Any]]:
    assert response.headers["content-type"].startswith("application/x-ndjson")
    return [json.loads(line) for line in response.text.splitlines()]


def metric(manager: ScriptedNodeManager, name: str, **labels: str) -> float:
    value = manager.metrics_registry.get_sample_value(name, {"role": labels.pop("role", "decode"), **labels})
    return 0.0 if value is None else value
