"""A real DetokenizationManager wired to real shared memory and to zmq sockets a test reads.

The test plays rank 0 (writing records through the ShmReqBuffer methods rank 0 uses) and reads
what the detokenizer sends to the HTTP process and to the router.
"""

from __future__ import annotations

import uuid
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Iterator

import zmq

from lightllm.server.core.objs.shm_req_buffer import ShmReqBuffer
from lightllm.server.detokenization.manager import DetokenizationConfig, DetokenizationManager
from lightllm.server.server_layout import ServerLayout


@dataclass
class DetokenizerRig:
    """The records the test writes, the manager under test, and the sockets it sends to."""

    shm: ShmReqBuffer
    manager: DetokenizationManager
    http: zmq.Socket
    router: zmq.Socket


@contextmanager
def detokenizer_rig(model_dir: Path, tmp_path: Path, slots: int) -> Iterator[DetokenizerRig]:
    """A :class:`DetokenizerRig` with ``slots`` request records; everything is closed on exit."""
    shm = ShmReqBuffer(f"lightllm_test_{uuid.uuid4().hex[:12]}", slots, 64, create=True)
    ctx = zmq.Context()
    addresses = {name: f"ipc://{tmp_path}/{name}.sock" for name in ("detok", "http", "router")}
    http = ctx.socket(zmq.PULL)
    http.bind(addresses["http"])
    router = ctx.socket(zmq.PULL)
    router.bind(addresses["router"])
    layout = ServerLayout(shm.name, "unused_stats", slots, 64, 64, addresses["router"], "unused_rank0",
                          addresses["detok"], addresses["http"])
    manager = DetokenizationManager(DetokenizationConfig(str(model_dir), "auto", layout, "warning", "detokenization"))
    try:
        yield DetokenizerRig(shm, manager, http, router)
    finally:
        manager.zmq_ctx.destroy(linger=0)
        manager.shm.close()
        ctx.destroy(linger=0)
        shm.close()
        shm.unlink()
