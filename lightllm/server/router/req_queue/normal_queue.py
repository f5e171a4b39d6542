"""Admission of waiting requests into the running batch (plain Python, no processes)."""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass
from typing import Callable, Deque, Dict, List, Tuple


@dataclass
class RouterReq:
    """What admission needs to know about a request.

    ``infer_high_priority`` (negative = high) and ``segment_index`` (0 for a first segment) are
    internal: only server code sets them (for example a PD master for a continuation segment),
    never a public API field.  Admission here does not order by them; they travel with the
    request so a queue that must (a PD node's) has them, and the model rank reads the same values
    from the request's record when it admits it.
    """

    request_id: int
    shm_index: int
    input_len: int
    max_new_tokens: int
    high_priority_request: bool = False
    infer_high_priority: int = 0
    segment_index: int = 0

    @property
    def projected_token_num(self) -> int:
        """KV tokens the request may hold at its largest: prompt plus every allowed new token."""
        return self.input_len + self.max_new_tokens


class NormalReqQueue:
    """FIFO admission with a high-priority lane, under a waiting bound.

    A request is admitted while the running batch has fewer than ``running_max_req_size``
    requests and the projected KV use stays within ``capacity``.  Projected use of a running
    request is the tokens it holds now plus the tokens it may still need (its prompt not yet
    prefilled and its remaining new-token allowance), which is ``input_len + max_new_tokens``.

    Rule (the router side of ``--prefill_max_wait_tokens``):

    * each lane (high priority, normal) is FIFO;
    * the lane whose head goes first is: the lane with an *aged* head (one that has waited more
      than ``max_wait_tokens`` prompt tokens admitted since it arrived), the earlier arrival if
      both heads are aged, otherwise the high-priority lane;
    * a head that does not fit blocks admission (its own lane and the other one) until it fits,
      so a stream of smaller requests cannot starve it; it is admitted alone when nothing runs.

    Hence a request waits for admission at most until ``max_wait_tokens`` prompt tokens have
    been admitted after it (plus the requests ahead of it in its own lane), and then until the
    running batch has drained enough for it.  The running batch drains because nothing else is
    admitted meanwhile and every running request ends (its generation is bounded and the
    backend's waiting bound serves its prefill), so neither the wait nor the block is forever.
    ``max_wait_tokens = 0`` disables aging: high-priority requests then always go first.
    """

    def __init__(self, capacity_tokens: int, running_max_req_size: int, max_wait_tokens: int = 0):
        if isinstance(max_wait_tokens, bool) or not isinstance(max_wait_tokens, int) or max_wait_tokens < 0:
            raise ValueError(f"max_wait_tokens must be an int >= 0 (0 disables aging), got {max_wait_tokens!r}")
        self.capacity_tokens = capacity_tokens
        self.running_max_req_size = running_max_req_size
        self.max_wait_tokens = max_wait_tokens
        self._high: Deque[RouterReq] = deque()
        self._normal: Deque[RouterReq] = deque()
        self.running: Dict[int, RouterReq] = {}
        # The router's clock: prompt tokens admitted so far.  Each waiting request remembers the
        # clock and an arrival sequence number when it was queued.
        self.admitted_prompt_tokens = 0
        self._arrival: Dict[int, Tuple[int, int]] = {}
        self._arrival_seq = 0

    def __len__(self) -> int:
        return len(self._high) + len(self._normal)

    def append(self, req: RouterReq) -> None:
        """Queue a new request."""
        self._arrival[req.request_id] = (self.admitted_prompt_tokens, self._arrival_seq)
        self._arrival_seq += 1
        (self._high if req.high_priority_request else self._normal).append(req)

    def remove_waiting(self, request_id: int) -> RouterReq | None:
        """Drop a waiting request (abort before admission); returns it if it was waiting."""
        for lane in (self._high, self._normal):
            for req in lane:
                if req.request_id == request_id:
                    lane.remove(req)
                    self._arrival.pop(request_id, None)
                    return req
        return None

    def release(self, request_id: int) -> None:
        """A running request left the batch."""
        self.running.pop(request_id, None)

    def projected_running_tokens(self) -> int:
        """Projected KV use of the running batch."""
        return sum(r.projected_token_num for r in self.running.values())

    def waited_tokens(self, req: RouterReq) -> int:
        """Prompt tokens admitted since ``req`` was queued (its wait on the router's clock)."""
        return self.admitted_prompt_tokens - self._arrival[req.request_id][0]

    def is_aged(self, req: RouterReq) -> bool:
        """Whether a waiting ``req`` has waited past ``max_wait_tokens`` (False when disabled)."""
        return self.max_wait_tokens > 0 and self.waited_tokens(req) > self.max_wait_tokens

    def _first_lane(self) -> Deque[RouterReq]:
        """The lane whose head is considered next (see the class docstring)."""
        if not self._high or not self._normal:
            return self._high or self._normal
        high_head, normal_head = self._high[0], self._normal[0]
        if not self.is_aged(normal_head):
            return self._high
        if not self.is_aged(high_head):
            return self._normal
        # Both heads aged: the earlier arrival goes first (the sequence number breaks ties).
        normal_first = self._arrival[normal_head.request_id] < self._arrival[high_head.request_id]
        return self._normal if normal_first else self._high

    def admit(self, extra_used_tokens: Callable[[], int] = lambda: 0) -> List[RouterReq]:
        """Move as many waiting requests into the running set as fit; returns them in order.

        ``extra_used_tokens`` reports KV held outside running requests that cannot be evicted.
        """
        admitted: List[RouterReq] = []
        used = self.projected_running_tokens() + extra_used_tokens()
        while len(self) and len(self.running) < self.running_max_req_size:
            lane = self._first_lane()
            req = lane[0]
            if used + req.projected_token_num > self.capacity_tokens and self.running:
                break  # the head waits for room, and nothing overtakes it
            lane.popleft()
            del self._arrival[req.request_id]
            self.running[req.request_id] = req
            used += req.projected_token_num
            self.admitted_prompt_tokens += req.input_len
            admitted.append(req)
        return admitted
