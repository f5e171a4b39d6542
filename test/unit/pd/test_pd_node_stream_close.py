"""Every node stream the master stops gives its connection back, whenever it is stopped.

The master reacts to a stream's lines by closing streams (a request's end), so a stream is often
stopped while its reader is already closing a connection the node just ended. A cancellation that
cut that close short left the connection in the HTTP client's pool for good, the node's side
closed (CLOSE-WAIT): an outside soak saw the master's file descriptors grow by one per 25
requests. Real HTTP on loopback (a uvicorn node stand-in), the master's own NodeStreams.
"""

from __future__ import annotations

import asyncio
import random
import threading
import time
from typing import Any, Iterator

import pytest
import uvicorn
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import StreamingResponse
from starlette.routing import Route

from lightllm.server.pd.master.node_streams import STREAM_END, NodeStreams
from lightllm.server.pd.protocol.node_info import NodeInfo
from lightllm.utils.free_ports import free_port


async def _decode(request: Request) -> StreamingResponse:
    lines = int((await request.json()).get("lines", 1))

    async def body() -> Any:
        for index in range(lines):
            if index:
                await asyncio.sleep(random.random() * 0.005)
            # The last line and the end of the body arrive together, as a node ends a stream.
            yield b'{"event": "token"}\n'


    return StreamingResponse(body(), media_type="application/x-ndjson")


@pytest.fixture(scope="module")
def node() -> Iterator[NodeInfo]:
    port = free_port()
    app = Starlette(routes=[Route("/pd/node/decode", _decode, methods=["POST"])])
    server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=port, log_level="error"))
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    deadline = time.monotonic() + 30
    while not server.started:
        assert time.monotonic() < deadline and thread.is_alive(), "the node stand-in did not start"
        time.sleep(0.02)
    yield NodeInfo("d", "decode", "m", "float32", 2, 2, 16, 1, f"127.0.0.1:{port}", "")
    server.should_exit = True
    thread.join(10)


def _open_connections(nodes: NodeStreams) -> int:
    # The pool is httpx's; a connection left in it after every stream ended is the leak.
    return len(nodes._client._transport._pool.connections)


@pytest.mark.parametrize("stop", ["cancel_on_each_line", "close_on_each_line", "cancel_at_random", "cancel_at_once",
                                  "never"])
def test_stopped_streams_leave_no_connection_open(node: NodeInfo, stop: str) -> None:
    async def run() -> int:
        nodes = NodeStreams()
        loop = asyncio.get_running_loop()
        rng = random.Random(7)
        late: list[Any] = []

        async def one(index: int) -> None:
            ended = asyncio.Event()
            holder: dict[str, Any] = {"cancelled": False}

            def sink(payload: Any) -> None:
                if holder["cancelled"]:
                    late.append(payload)  # a line reached the sink after cancel()
                if stop == "cancel_on_each_line":
                    loop.call_soon(holder["stream"].cancel)  # the master reacting to the line
                elif stop == "close_on_each_line":
                    loop.create_task(holder["stream"].close())
                if payload is STREAM_END or not isinstance(payload, dict):
                    ended.set()

            holder["stream"] = nodes.stream(node, "/pd/node/decode", {"lines": 1 + index % 3}, sink)
            if stop == "cancel_at_once":  # before the reader first runs
                holder["stream"].cancel()
                holder["cancelled"] = True
            elif stop == "cancel_at_random":
                await asyncio.sleep(rng.random() * 0.02)
                holder["stream"].cancel()
                holder["cancelled"] = True
            else:
                await asyncio.wait_for(ended.wait(), 10) if stop == "never" else await asyncio.sleep(0.05)
            await holder["stream"].close()

        await asyncio.gather(*(one(index) for index in range(60)))
        await asyncio.sleep(0.2)
        left = _open_connections(nodes)
        await nodes.aclose()
        assert late == []
        return left

    assert asyncio.run(run()) == 0
