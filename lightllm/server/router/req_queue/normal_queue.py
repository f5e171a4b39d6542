"""Admission of waiting requests into the running batch (plain Python, no processes)."""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass
from typing import Callable, Deque, Dict, List


@dataclass
class RouterReq:
    """What admission needs to know about a request."""

    request_id: int
    shm_index: int
    input_len: int
    max_new_tokens: int
    high_priority_request: bool = False

    @property
    def projected_token_num(self) -> int:
        """KV tokens the request may hold at its largest: prompt plus every allowed new token."""
        return self.input_len + self.max_new_tokens


class NormalReqQueue:
    """FIFO admission with a high-priority lane.

    A request is admitted while the running batch has fewer than ``running_max_req_size``
    requests and the projected KV use stays within ``capacity``.  Projected use of a running
    request is the tokens it holds now plus the tokens it may still need (its prompt not yet
    prefilled and its remaining new-token allowance), which is ``input_len + max_new_tokens``.
    Requests flagged ``high_priority_request`` are admitted before normal ones, FIFO among
    themselves; a request that does not fit blocks the ones behind it in its lane so that large
    requests are not starved by a stream of small ones.
    """

    def __init__(self, capacity_tokens: int, running_max_req_size: int):
        self.capacity_tokens = capacity_tokens
        self.running_max_req_size = running_max_req_size
        self._high: Deque[RouterReq] = deque()
        self._normal: Deque[RouterReq] = deque()
        self.running: Dict[int, RouterReq] = {}

    def __len__(self) -> int:
        return len(self._high) + len(self._normal)

    def append(self, req: RouterReq) -> None:
        """Queue a new request."""
        (self._high if req.high_priority_request else self._normal).append(req)

    def remove_waiting(self, request_id: int) -> RouterReq | None:
        """Drop a waiting request (abort before admission); returns it if it was waiting."""
        for lane in (self._high, self._normal):
            for req in lane:
                if req.request_id == request_id:
                    lane.remove(req)
                    return req
        return None

    def release(self, request_id: int) -> None:
        """A running request left the batch."""
        self.running.pop(request_id, None)

    def projected_running_tokens(self) -> int:
        """Projected KV use of the running batch."""
        return sum(r.projected_token_num for r in self.running.values())

    def admit(self, extra_used_tokens: Callable[[], int] = lambda: 0) -> List[RouterReq]:
        """Move as many waiting requests into the running set as fit; returns them in order.

        ``extra_used_tokens`` reports KV held outside running requests that cannot be evicted.
        """
        admitted: List[RouterReq] = []
        used = self.projected_running_tokens() + extra_used_tokens()
        for lane in (self._high, self._normal):
            while lane and len(self.running) < self.running_max_req_size:
                req = lane[0]
                if used + req.projected_token_num > self.capacity_tokens and self.running:
                    break
                lane.popleft()
                self.running[req.request_id] = req
                used += req.projected_token_num
                admitted.append(req)
            if lane:
                break  # a blocked high-priority head keeps normal requests waiting too
        return admitted
