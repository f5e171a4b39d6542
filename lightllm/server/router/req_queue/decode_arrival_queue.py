"""``DecodeArrivalQueue``: a PD decode node's router admits every arrival at once.

A decode node's requests arrive with their prompt prefilled on the prefill node and the master
waiting for an answer: model rank 0 reserves KV for each at once or answers busy at once, naming
the limit it hit, never after a wait (``DecodeBackend.reserve_prefilled``).  So the router does
not hold them back for KV room, request rows or the admission cadence; the next admission round
(in the same loop iteration as the arrival) sends them all.  They still join the running set, so
their aborts and releases work as on any node.
"""

from __future__ import annotations

from typing import Dict, List, Optional

from lightllm.server.router.req_queue.base_queue import ReqQueue
from lightllm.server.router.req_queue.router_req import RouterReq


class DecodeArrivalQueue(ReqQueue):
    """Admits every waiting request in arrival order, at every round (see the module docstring).

    The constructor takes the same arguments as every queue (``build_req_queue``); the limits do
    not apply here, since the ranks check them request by request.
    """

    def __init__(self, capacity_tokens: int = 0, running_max_req_size: int = 0, overtake_bound: object = None) -> None:
        super().__init__()
        # Insertion order is arrival order.
        self._waiting: Dict[int, RouterReq] = {}

    def __len__(self) -> int:
        return len(self._waiting)

    def append(self, req: RouterReq) -> None:
        """Queue an arrival for the next round."""
        self._waiting[req.request_id] = req

    def remove_waiting(self, request_id: int) -> Optional[RouterReq]:
        """Drop an arrival not yet admitted; returns it if it was waiting."""
        return self._waiting.pop(request_id, None)

    def admission_due(self, steps_since_admission: int, wait_steps: int) -> bool:
        """Always: an arrival is answered at once."""
        return True

    def admit(self) -> List[RouterReq]:
        """Every waiting request, in arrival order, into the running set."""
        admitted = list(self._waiting.values())
        self._waiting.clear()
        for req in admitted:
            self.running[req.request_id] = req
        return admitted
