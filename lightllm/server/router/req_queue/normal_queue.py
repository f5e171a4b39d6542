"""Admission of waiting requests into the running batch under KV and request limits (normal and prefill nodes)."""

from __future__ import annotations

from collections import deque
from bisect import bisect_right
from typing import Deque, Dict, List, Optional, Set, Tuple

from lightllm.server.model_rank.scheduling.prefill_queue_strategy.overtake_bound import OvertakeBoundSpec
from lightllm.server.router.req_queue.base_queue import ReqQueue
from lightllm.server.router.req_queue.router_req import RouterReq, RunningRequests

__all__ = ["NormalReqQueue", "RouterReq", "RunningRequests"]


class NormalReqQueue(ReqQueue):
    """FIFO admission with a high-priority lane, under the overtaking bound.

    A request is admitted while the running batch has fewer than ``running_max_req_size``
    requests and the projected KV use stays within ``capacity``.  Projected use of a running
    request is the tokens it holds now plus the tokens it may still need (its prompt not yet
    prefilled and its remaining new-token allowance), which is ``input_len + max_new_tokens``.

    Rule (the router side of ``--prefill_max_overtake_tokens`` / ``--prefill_overtake_fraction``):

    * each lane (high priority, normal) is FIFO; the yardstick is arrival order over both lanes,
      and the high-priority lane is the reordering the bound limits;
    * a normal request's *allowance* is ``base + floor(fraction * ahead)``, where ``ahead`` is the
      prompt tokens waiting in either lane when it arrived (its first-come-first-served wait on
      the router's clock, prompt tokens admitted); it is *overtaken* by the prompt tokens of
      high-priority requests that arrived after it and were admitted before it;
    * the high-priority head goes first, unless the normal head is *protected* (overtaken tokens
      >= allowance) and arrived before the high-priority head;
    * a head that does not fit blocks admission (its own lane and the other one) until it fits,
      so a stream of smaller requests cannot starve it; it is admitted alone when nothing runs.

    Hence high-priority traffic can put at most ``allowance + one request's prompt`` tokens of
    later work ahead of a normal request, and then waits behind it; the running batch drains
    because nothing else is admitted meanwhile and every running request ends, so neither the
    wait nor the block is forever.  With the bound disabled high-priority requests always go first.
    """

    def __init__(
        self, capacity_tokens: int, running_max_req_size: int, overtake_bound: Optional[OvertakeBoundSpec] = None
    ):
        super().__init__()
        self.overtake_bound = overtake_bound if overtake_bound is not None else OvertakeBoundSpec()
        if not isinstance(self.overtake_bound, OvertakeBoundSpec):
            raise ValueError(f"overtake_bound must be an OvertakeBoundSpec, got {overtake_bound!r}")
        self.capacity_tokens = capacity_tokens
        self.running_max_req_size = running_max_req_size
        # The lanes in arrival order.  An aborted waiting request is only marked (``_removed``,
        # by identity) and dropped once it reaches its lane's head, so an abort costs O(1) and
        # not a scan of a long lane; a lane's head is never a removed request.
        self._high: Deque[RouterReq] = deque()
        self._normal: Deque[RouterReq] = deque()
        self._waiting: Dict[int, RouterReq] = {}
        self._removed: Set[int] = set()
        # The router's clock: prompt tokens admitted so far.
        self.admitted_prompt_tokens = 0
        # Per waiting request: arrival sequence number and overtaking allowance.
        self._arrival: Dict[int, Tuple[int, int]] = {}
        self._arrival_seq = 0
        self._waiting_prompt_tokens = 0
        # Admitted high-priority requests as (arrival seq, high prompt tokens admitted before it),
        # in admission order, which is arrival order (the lane is FIFO); trimmed to what a
        # waiting normal request can still ask about.
        self._high_admitted: List[Tuple[int, int]] = []
        self._high_admitted_tokens = 0

    def __len__(self) -> int:
        return len(self._waiting)

    def append(self, req: RouterReq) -> None:
        """Queue a new request."""
        allowance = self.overtake_bound.allowance(self._waiting_prompt_tokens)
        self._arrival[req.request_id] = (self._arrival_seq, allowance)
        self._arrival_seq += 1
        self._waiting_prompt_tokens += req.input_len
        self._waiting[req.request_id] = req
        (self._high if req.high_priority_request else self._normal).append(req)

    def waiting_requests(self) -> List[RouterReq]:
        """The waiting requests: the high-priority lane, then the normal one, each in arrival order."""
        removed = self._removed
        return [req for lane in (self._high, self._normal) for req in lane if id(req) not in removed]

    def remove_waiting(self, request_id: int) -> RouterReq | None:
        """Drop a waiting request (abort before admission); returns it if it was waiting.  O(1)."""
        req = self._waiting.get(request_id)
        if req is None:
            return None
        self._removed.add(id(req))
        self._forget(req)
        return req

    def admission_due(self, steps_since_admission: int, wait_steps: int) -> bool:
        """Admit again once the backend ran ``wait_steps`` steps since the last admission, or sits idle."""
        return not self.running or steps_since_admission >= wait_steps

    def overtaken_tokens(self, req: RouterReq) -> int:
        """Prompt tokens of high-priority requests that arrived after waiting ``req`` and were admitted."""
        seq = self._arrival[req.request_id][0]
        index = bisect_right(self._high_admitted, (seq, float("inf")))
        if index == len(self._high_admitted):
            return 0
        return self._high_admitted_tokens - self._high_admitted[index][1]

    def is_protected(self, req: RouterReq) -> bool:
        """Whether a waiting normal ``req`` has been overtaken by its whole allowance."""
        return self.overtake_bound.enabled and self.overtaken_tokens(req) >= self._arrival[req.request_id][1]

    def _first_lane(self) -> Deque[RouterReq]:
        """The lane whose head is considered next (see the class docstring)."""
        if not self._high or not self._normal:
            return self._high or self._normal
        high_head, normal_head = self._high[0], self._normal[0]
        normal_earlier = self._arrival[normal_head.request_id][0] < self._arrival[high_head.request_id][0]
        if normal_earlier and self.is_protected(normal_head):
            return self._normal
        return self._high

    def _forget(self, req: RouterReq) -> None:
        """``req`` left the waiting lanes (admitted or aborted)."""
        del self._arrival[req.request_id]
        del self._waiting[req.request_id]
        removed = self._removed
        if removed:
            for lane in (self._high, self._normal):
                while lane and id(lane[0]) in removed:
                    removed.discard(id(lane.popleft()))
        self._waiting_prompt_tokens -= req.input_len
        # Entries older than every waiting normal request can no longer be asked about.
        if self._high_admitted and (not self._normal or len(self._high_admitted) > 64):
            oldest = self._arrival[self._normal[0].request_id][0] if self._normal else self._arrival_seq
            keep = bisect_right(self._high_admitted, (oldest, float("inf")))
            if keep:
                del self._high_admitted[:keep]

    def admit(self) -> List[RouterReq]:
        """Move as many waiting requests into the running set as fit; returns them in order."""
        admitted: List[RouterReq] = []
        used = self.projected_running_tokens()
        while len(self) and len(self.running) < self.running_max_req_size:
            lane = self._first_lane()
            req = lane[0]
            if used + req.projected_token_num > self.capacity_tokens and self.running:
                break  # the head waits for room, and nothing overtakes it
            lane.popleft()
            if req.high_priority_request:
                seq = self._arrival[req.request_id][0]
                self._high_admitted.append((seq, self._high_admitted_tokens))
                self._high_admitted_tokens += req.input_len
            self._forget(req)
            self.running[req.request_id] = req
            used += req.projected_token_num
            self.admitted_prompt_tokens += req.input_len
            admitted.append(req)
        return admitted
