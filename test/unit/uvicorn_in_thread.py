"""A real uvicorn server on a free loopback port, in a thread of the test process, for the length of a ``with``
(alone, or behind the front door as ``api_server`` serves it)."""

from __future__ import annotations

import contextlib
import threading
import time
from typing import Any, Iterator

import uvicorn

from lightllm.server.http.app import create_app
from lightllm.server.http.front_door import FrontDoor
from lightllm.server.http.listen_sockets import bind_listeners
from lightllm.server.http.protocol import guarded_protocol_class
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
    config = uvicorn.Config(create_app(manager, options), log_level="error", http=guarded_protocol_class(options.limits))
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
