"""A real uvicorn server on a free loopback port, in a thread of the test process: for the length of a ``with``
(alone, or behind the front door as ``api_server`` serves it), or as a :class:`ThreadServer` a test stops
itself, with its own event loop to run coroutines on (the PD master and node stand-ins)."""

from __future__ import annotations

import asyncio
import contextlib
import socket
import threading
import time
from typing import Any, Iterator, Optional

import uvicorn
from fastapi import FastAPI

from lightllm.server.http.app import create_app
from lightllm.server.http.transport.front_door import FrontDoor
from lightllm.server.http.transport.listen_sockets import bind_listeners
from lightllm.server.http.transport.protocol import guarded_protocol_class
from lightllm.server.http.transport.uvicorn_config import CLIENT_ADDRESS_SETTINGS
from lightllm.server.http.server_options import HttpLimits, HttpServerOptions
from lightllm.server.launch.supervisor import SupervisedServer, Supervisor
from lightllm.utils.free_ports import free_port


@contextlib.contextmanager
def serving_in_thread(app: Any, limits: HttpLimits, **config: Any) -> Iterator[int]:
    """Serve ``app`` with the guarded protocol bound to ``limits``; yields the port (``config``: uvicorn.Config's)."""
    port = free_port()
    server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=port, log_level="error",
                                           http=guarded_protocol_class(limits), **config))
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    deadline = time.monotonic() + 30
    while not server.started:
        assert time.monotonic() < deadline and thread.is_alive(), "uvicorn did not start"
        time.sleep(0.02)
    try:
        yield port
    finally:
        server.should_exit = True
        server.force_exit = True
        thread.join(10)


@contextlib.contextmanager
def serving_behind_front_door(manager: Any, options: HttpServerOptions) -> Iterator[FrontDoor]:
    """The app over ``manager`` behind a front door on a free loopback port, as ``api_server`` serves
    it (the door built from ``options``' limits, keys and CORS origins); yields the door (its ``port``)."""
    door = FrontDoor(bind_listeners("127.0.0.1", 0), options.limits, options.auth, options.allowed_origins)
    door.start()
    config = uvicorn.Config(create_app(manager, options), log_level="error", http=guarded_protocol_class(options.limits),
                            **CLIENT_ADDRESS_SETTINGS)
    server = SupervisedServer(config, Supervisor(manager, 0), front_door=door)
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    deadline = time.monotonic() + 30
    while not door.serving:
        assert time.monotonic() < deadline and thread.is_alive(), "uvicorn did not start"
        time.sleep(0.02)
    try:
        yield door
    finally:
        server.should_exit = True
        thread.join(10)
        door.close()


class ThreadServer:
    """A FastAPI app served by uvicorn in a thread on a free loopback port."""

    def __init__(self, app: FastAPI) -> None:
        sock = socket.socket()
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind(("127.0.0.1", 0))
        self.port = sock.getsockname()[1]
        self._sock = sock
        self.loop: Optional[asyncio.AbstractEventLoop] = None
        self.server = uvicorn.Server(uvicorn.Config(app, log_level="warning", timeout_graceful_shutdown=1))
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()
        deadline = time.monotonic() + 30
        while not self.server.started:
            assert self._thread.is_alive() and time.monotonic() < deadline, "uvicorn did not start"
            time.sleep(0.01)

    def _run(self) -> None:
        self.loop = asyncio.new_event_loop()
        asyncio.set_event_loop(self.loop)
        self.loop.run_until_complete(self.server.serve(sockets=[self._sock]))

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def call(self, coro: Any, timeout: float = 10) -> Any:
        """Run ``coro`` on the server's loop and wait for its result."""
        assert self.loop is not None
        return asyncio.run_coroutine_threadsafe(coro, self.loop).result(timeout)

    def stop(self) -> None:
        self.server.should_exit = True
        self._thread.join(timeout=10)
        self._sock.close()
