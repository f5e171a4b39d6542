"""Admission of waiting requests into the running batch under KV and request limits (normal and prefill nodes)."""

from __future__ import annotations

import heapq
from collections import deque
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
    * the high-priority head goes first, unless some waiting normal request that arrived before
      it is *protected* (overtaken tokens >= allowance): then the normal lane goes first, in its
      FIFO order, until no such request waits.  Any normal request counts, not only the lane's
      head: an older head can have a much larger allowance (it arrived behind a long prompt)
      than a request queued behind it;
    * a head that does not fit blocks admission (its own lane and the other one) until it fits,
      so a stream of smaller requests cannot starve it; it is admitted alone when nothing runs.

    Hence high-priority traffic can put at most ``allowance + one request's prompt`` tokens of
    later work ahead of a normal request, and then waits behind it; the running batch drains
    because nothing else is admitted meanwhile and every running request ends, so neither the
    wait nor the block is forever.  With the bound disabled high-priority requests always go first.

    Cost: each decision is O(log n) amortized, not a scan of the normal lane.  High-priority
    requests are admitted in arrival order, so once every high-priority request that arrived
    before a normal request ``r`` has left its lane, the high-priority tokens admitted before
    ``r``'s first overtaker (``r``'s *base*) are final, and ``overtaken(r) = T - base(r)`` with
    ``T`` the high-priority prompt tokens admitted so far.  ``r`` is protected once
    ``T >= base(r) + allowance(r)``, its *threshold*, which never changes; a min-heap of the
    thresholds of those requests (all of which arrived before the high-priority head) answers
    the rule with one comparison.
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
        # T: prompt tokens of the high-priority requests admitted so far.
        self._high_admitted_tokens = 0
        # Normal requests (arrival seq, request id) in arrival order whose base is not final yet:
        # a high-priority request that arrived before them may still be admitted.  Stale entries
        # (admitted or aborted) are skipped lazily.
        self._unsettled: Deque[Tuple[int, int]] = deque()
        # Waiting normal request id -> its base (see the class docstring), once final.
        self._base: Dict[int, int] = {}
        # Min-heap of (threshold, arrival seq, request id) of the settled requests; stale entries
        # are dropped when they reach the top, and the heap is rebuilt when they pile up.
        self._thresholds: List[Tuple[int, int, int]] = []

    def __len__(self) -> int:
        return len(self._waiting)

    def append(self, req: RouterReq) -> None:
        """Queue a new request."""
        allowance = self.overtake_bound.allowance(self._waiting_prompt_tokens)
        seq = self._arrival_seq
        self._arrival[req.request_id] = (seq, allowance)
        self._arrival_seq += 1
        self._waiting_prompt_tokens += req.input_len
        self._waiting[req.request_id] = req
        if req.high_priority_request:
            self._high.append(req)
        else:
            self._normal.append(req)
            self._unsettled.append((seq, req.request_id))

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
        base = self._base.get(req.request_id)
        # Unsettled: every admitted high-priority request arrived before ``req`` (an admission
        # settles every normal request that arrived before the admitted one first).
        return 0 if base is None else self._high_admitted_tokens - base

    def _is_waiting(self, seq: int, request_id: int) -> bool:
        """Whether the request that arrived as ``seq`` still waits (ids may be reused later)."""
        entry = self._arrival.get(request_id)
        return entry is not None and entry[0] == seq

    def _settle(self) -> None:
        """Fix the base of every normal request that arrived before the high-priority head.

        Called before every admission decision, so before every high-priority admission: the
        base is then the high-priority tokens admitted so far, exactly those that arrived earlier.
        """
        head_seq = self._arrival[self._high[0].request_id][0] if self._high else self._arrival_seq
        unsettled = self._unsettled
        while unsettled and unsettled[0][0] < head_seq:
            seq, request_id = unsettled.popleft()
            if not self._is_waiting(seq, request_id):
                continue
            base = self._high_admitted_tokens
            self._base[request_id] = base
            heapq.heappush(self._thresholds, (base + self._arrival[request_id][1], seq, request_id))

    def _protected_before_high_head(self) -> bool:
        """Whether a waiting normal request that arrived before the high-priority head is protected."""
        thresholds = self._thresholds
        while thresholds and not self._is_waiting(thresholds[0][1], thresholds[0][2]):
            heapq.heappop(thresholds)
        return bool(thresholds) and thresholds[0][0] <= self._high_admitted_tokens

    def _first_lane(self) -> Deque[RouterReq]:
        """The lane whose head is considered next (see the class docstring)."""
        self._settle()
        if not self._high or not self._normal:
            return self._high or self._normal
        if self.overtake_bound.enabled and self._protected_before_high_head():
            return self._normal
        return self._high

    def _forget(self, req: RouterReq) -> None:
        """``req`` left the waiting lanes (admitted or aborted)."""
        del self._arrival[req.request_id]
        del self._waiting[req.request_id]
        self._base.pop(req.request_id, None)
        removed = self._removed
        if removed:
            for lane in (self._high, self._normal):
                while lane and id(lane[0]) in removed:
                    removed.discard(id(lane.popleft()))
        self._waiting_prompt_tokens -= req.input_len
        # Stale entries leave the heap and the unsettled deque lazily; rebuild them once stale
        # ones dominate, so memory stays O(waiting) and the cost stays amortized O(1) per request.
        limit = 2 * len(self._waiting) + 64
        if len(self._thresholds) > limit:
            self._thresholds = [e for e in self._thresholds if self._is_waiting(e[1], e[2])]
            heapq.heapify(self._thresholds)
        if len(self._unsettled) > limit:
            self._unsettled = deque(e for e in self._unsettled if self._is_waiting(*e))

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
                self._high_admitted_tokens += req.input_len
            self._forget(req)
            self.running[req.request_id] = req
            used += req.projected_token_num
            self.admitted_prompt_tokens += req.input_len
            admitted.append(req)
        return admitted
