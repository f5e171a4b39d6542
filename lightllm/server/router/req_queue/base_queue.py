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

# ``--router_max_wait_tokens``'s default: backend steps between two admission rounds while
# requests run (the server's argument parser and the simulator's config both take it from here).
DEFAULT_ROUTER_MAX_WAIT_TOKENS = 1


class ReqQueue(ABC):
    """A run mode's admission queue (see the module docstring)."""

    def __init__(self) -> None:
        self.running: RunningRequests = RunningRequests()
        # The backend's step count at the last round that admitted anything (see admit_if_due);
        # far in the past at first, so the first round is due whatever the cadence.
        self._steps_at_last_admission = -(10**9)

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

    def admit_if_due(self, backend_steps: int, wait_steps: int) -> List[RouterReq]:
        """One admission round on the router's cadence: :meth:`admit` when :meth:`admission_due`.

        ``backend_steps``: steps the backend has run so far (the router passes rank 0's
        ``backend_steps`` counter, the simulator its own count of backend steps);
        ``wait_steps``: ``--router_max_wait_tokens``.  The queue remembers the count at the last
        round that admitted anything, so the router and the simulator pace admission alike.
        """
        if not len(self) or not self.admission_due(backend_steps - self._steps_at_last_admission, wait_steps):
            return []
        admitted = self.admit()
        if admitted:
            self._steps_at_last_admission = backend_steps
        return admitted

    def release(self, request_id: int) -> None:
        """A running request left the batch."""
        self.running.pop(request_id, None)

    def projected_running_tokens(self) -> int:
        """Projected KV use of the running batch (kept current by :class:`RunningRequests`)."""
        return self.running.projected_tokens
