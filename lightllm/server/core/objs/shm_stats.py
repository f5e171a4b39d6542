"""A small shared-memory block of live counters for /metrics.

Writers: the router writes the queue fields, model rank 0 the KV and step fields.  Each field
has one writer, so plain stores suffice; readers (the HTTP process) may see values from
different moments, which is fine for gauges.
"""

from __future__ import annotations

from typing import Dict

import numpy as np

from lightllm.server.core.objs.iteration_tokens_histogram import ITERATION_TOKEN_FIELDS
from lightllm.server.core.objs.prefill_wait_histogram import PREFILL_WAIT_FIELDS
from lightllm.server.core.objs.shared_segment import SharedArraySegment


STAT_FIELDS = (
    "waiting_requests",  # router
    "running_requests",  # router
    "kv_total_tokens",  # rank 0
    "kv_free_tokens",  # rank 0: allocator free slots
    "kv_cached_tokens",  # rank 0: slots held by the prefix cache
    "kv_allocatable_tokens",  # rank 0: free + evictable prefix-cache slots
    "kv_promised_tokens",  # rank 0: decode node's reservations' KV still to allocate (0 elsewhere)
    "paused_requests",  # rank 0
    "grammar_held_requests",  # rank 0: held until their grammar compiled (vLLM's WAITING_FOR_FSM)
    "backend_steps",  # rank 0
    "processed_prefill_tokens",  # rank 0
    "step_schedule_us",  # rank 0, cumulative: filter/order/select
    "step_forward_us",  # rank 0, cumulative: model forwards
    "step_sample_us",  # rank 0, cumulative: sampling and finish checks
    "step_publish_us",  # rank 0, cumulative: shared-memory writes and messages
    "preemptions",  # rank 0, cumulative: requests paused to free KV cache
) + PREFILL_WAIT_FIELDS + ITERATION_TOKEN_FIELDS  # rank 0: prefill waits, tokens per step (histograms)


class ShmStats(SharedArraySegment):
    """Named int64 counters in a shared-memory segment."""

    def __init__(self, name: str, create: bool):
        super().__init__(name, np.dtype(np.int64), len(STAT_FIELDS), create)
        self.values = self.array
        if create:
            self.values[:] = 0
        self._index = {name: i for i, name in enumerate(STAT_FIELDS)}

    @staticmethod
    def segment_bytes() -> int:
        """Bytes of the segment (for the launcher's /dev/shm check)."""
        return np.dtype(np.int64).itemsize * len(STAT_FIELDS)

    def set(self, field: str, value: int) -> None:
        """Store one counter."""
        self.values[self._index[field]] = value

    def get(self, field: str) -> int:
        """Read one counter."""
        return int(self.values[self._index[field]])

    def snapshot(self) -> Dict[str, int]:
        """All counters."""
        return {name: int(self.values[i]) for name, i in self._index.items()}

    def close(self) -> None:
        """Unmap the block."""
        self.values = None
        super().close()
