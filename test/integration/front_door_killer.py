"""``python front_door_killer.py ARGS``: the real server, whose front door thread dies on a marked request.

Stands in for a thread that fails by itself (an ``OverflowError`` from ``select`` was seen): a
request whose head holds :data:`KILL_MARK` makes the thread raise that error after handling it.
"""

from __future__ import annotations

import runpy

KILL_MARK = b"/__kill_the_front_door__"


def _arm() -> None:
    from lightllm.server.http.transport.front_door import FrontDoor

    original = FrontDoor._on_readable

    def on_readable(self: FrontDoor, pending) -> None:  # type: ignore[no-untyped-def]
        original(self, pending)  # reads the request into pending.data
        if KILL_MARK in pending.data:
            raise OverflowError("timeout is too large")

    FrontDoor._on_readable = on_readable  # type: ignore[method-assign]


if __name__ == "__main__":  # spawned children import this file as __mp_main__: they must not serve
    _arm()
    runpy.run_module("lightllm.server.api_server", run_name="__main__", alter_sys=True)
