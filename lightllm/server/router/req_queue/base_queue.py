"""``ReqQueue``: what the router asks of a run mode's admission queue (plain Python, no processes).

A queue holds the requests that reached the router and have not been admitted yet, decides which
to admit and when, and keeps the running set (requests admitted and not yet released by the
model ranks).  ``build_req_queue(run_mode, ...)`` (``queue_registry.py``) picks the class; the
router's process shell is the same for every run mode.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from typing import List, Optional

from lightllm.server.router.req_queue.router_req import RouterReq, RunningRequests


class ReqQueue(ABC):
    """A run mode's admission queue (see the module docstring)."""

    def __init__(self) -> None:
        self.running: RunningRequests = RunningRequests()

    @abstractmethod
    def __len__(self) -> int:
        """Requests waiting for admission."""

    @abstractmethod
    def append(self, req: RouterReq) -> None:
        """A new request reached the router."""

    @abstractmethod
    def remove_waiting(self, request_id: int) -> Optional[RouterReq]:
        """Drop a waiting request (aborted before admission); returns it if it was waiting."""

    @abstractmethod
    def admission_due(self, steps_since_admission: int, wait_steps: int) -> bool:
        """Whether an admission round runs now.

        ``steps_since_admission``: backend steps since the last round that admitted anything;
        ``wait_steps``: ``--router_max_wait_tokens``, the cadence a queue may follow.
        """

    @abstractmethod
    def admit(self) -> List[RouterReq]:
        """Move the requests admitted now into the running set; returns them in order."""

    def release(self, request_id: int) -> None:
        """A running request left the batch."""
        self.running.pop(request_id, None)

    def projected_running_tokens(self) -> int:
        """Projected KV use of the running batch (kept current by :class:`RunningRequests`)."""
        return self.running.projected_tokens
