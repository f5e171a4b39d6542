"""A request buffer in a shared-memory segment of its own, for tests."""

from __future__ import annotations

import uuid
from contextlib import contextmanager
from typing import Iterator

from lightllm.server.core.objs.shm_req_buffer import ShmReqBuffer


@contextmanager
def scratch_req_buffer(slot_num: int, max_req_total_len: int, top_slot_num: int = 0) -> Iterator[ShmReqBuffer]:
    """A request buffer in a fresh shared-memory segment, removed afterwards."""
    buffer = ShmReqBuffer(f"lightllm_test_{uuid.uuid4().hex[:12]}", slot_num, max_req_total_len, create=True,
                          top_slot_num=top_slot_num)
    try:
        yield buffer
    finally:
        buffer.close()
        buffer.unlink()
