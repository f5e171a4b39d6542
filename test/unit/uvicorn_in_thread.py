"""A real uvicorn server on a free loopback port, in a thread of the test process, for the length of a ``with``."""

from __future__ import annotations

import contextlib
import threading
import time
from typing import Any, Iterator

import uvicorn

from lightllm.server.http.protocol import guarded_protocol_class
from lightllm.server.http.server_options import HttpLimits
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
