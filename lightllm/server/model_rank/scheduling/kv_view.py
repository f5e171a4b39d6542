"""What the step engine needs from a KV cache, and a token-count implementation of it.

The engine never sees slots or tensors.  It asks how many tokens could be allocated and how many
requests the view can hold at once, and tells the KV view when a request arrives, needs room for
its next tokens, gives its KV back (pause), takes it again (resume) or leaves.  The server's view is ``InferenceContext`` (token slots, the
request manager's rows and the radix prefix cache); the simulator's is :class:`TokenCountKvView`.

Invariants every view keeps, per request: ``0 <= cur_kv_len <= kv_slot_len``; positions
``[0, kv_slot_len)`` hold KV slots; the engine advances ``cur_kv_len`` after a forward computed
those positions, the view moves ``kv_slot_len``.
"""

from __future__ import annotations

from typing import Optional, Protocol, Sequence, Tuple

from lightllm.server.model_rank.scheduling.infer_req import InferReq


class KvView(Protocol):
    """The KV cache as the step engine uses it (see the module docstring)."""

    def allocatable_token_num(self) -> int:
        """Tokens that could be given to requests now (free plus evictable)."""

    def capacity_token_num(self) -> int:
        """Tokens the view holds in all (the KV cache's size): a request needing more never fits."""

    def max_requests(self) -> int:
        """Requests the view can hold at once (the server's request rows, ``--running_max_req_size``).

        A PD decode node refuses a reservation once this many requests are live
        (``DecodeBackend.reserve_prefilled``).
        """

    def attach(self, req: InferReq) -> None:
        """Take in a new request: reuse any cached prefix (sets ``cur_kv_len`` and ``kv_slot_len``)."""

    def reserve(self, req: InferReq, num: int) -> None:
        """Give ``req`` slots for its next ``num`` positions, ``[kv_slot_len, kv_slot_len + num)``.

        Called for every chunk before its forward, and by a decode node ahead of a transfer.
        Asking for more than :meth:`allocatable_token_num` is a scheduling bug and raises.
        """

    def reserve_many(self, wants: Sequence[Tuple[InferReq, int]]) -> None:
        """:meth:`reserve` for each ``(request, num)`` pair, in one allocation."""

    def share_prefix(self, req: InferReq) -> int:
        """Between steps, for a request still prefilling: publish its computed tokens to a prefix
        cache and adopt a longer cached prefix; returns the tokens gained (0 without a cache)."""

    def pause(self, req: InferReq) -> None:
        """Take all of ``req``'s KV back (computed tokens may stay in a prefix cache)."""

    def resume(self, req: InferReq) -> None:
        """Re-attach a paused request's cached prefix; what is missing becomes prefill work."""

    def release(self, req: InferReq) -> None:
        """``req`` leaves: its KV goes to the prefix cache or back to the free pool."""


class TokenCountKvView:
    """A KV view that only counts tokens (no slots, no prefix cache): the simulator's.

    The server's allocator hands out individual slots, but every scheduling decision only looks
    at how many could be allocated, so a count gives the same decisions.  A released or paused
    request's tokens return to the pool at once.

    ``max_requests``: the request rows it reports (the server's ``--running_max_req_size``);
    None: ``capacity``, which never binds before the tokens do on a decode node (every
    reservation holds at least one token).  The view only reports the number, as the scheduling
    core only reads it: the router caps a normal node's batch, and a decode node's backend
    checks it before it reserves.
    """

    def __init__(self, capacity: int, max_requests: Optional[int] = None) -> None:
        if isinstance(capacity, bool) or not isinstance(capacity, int) or capacity < 1:
            raise ValueError(f"capacity must be an int >= 1, got {capacity!r}")
        if max_requests is None:
            max_requests = capacity
        if isinstance(max_requests, bool) or not isinstance(max_requests, int) or max_requests < 1:
            raise ValueError(f"max_requests must be None or an int >= 1, got {max_requests!r}")
        self.capacity = capacity
        self.rows = max_requests
        self.used = 0

    def allocatable_token_num(self) -> int:
        """Tokens that can be reserved now."""
        return self.capacity - self.used

    def capacity_token_num(self) -> int:
        """The ``capacity`` given to the constructor."""
        return self.capacity

    def max_requests(self) -> int:
        """The request rows given to the constructor."""
        return self.rows

    def attach(self, req: InferReq) -> None:
        """Nothing is cached: the request starts from position 0."""
        req.cur_kv_len = 0
        req.kv_slot_len = 0

    def reserve(self, req: InferReq, num: int) -> None:
        """Count ``num`` more tokens for ``req``; running out is a scheduling bug, so it raises."""
        if num < 0:
            raise ValueError(f"num must be >= 0, got {num}")
        if num > self.capacity - self.used:
            raise RuntimeError(f"KV pool exhausted: asked for {num} tokens, {self.capacity - self.used} free")
        self.used += num
        req.kv_slot_len += num

    def reserve_many(self, wants: Sequence[Tuple[InferReq, int]]) -> None:
        """:meth:`reserve` for each ``(request, num)`` pair."""
        if sum(num for _, num in wants) > self.capacity - self.used:
            raise RuntimeError(f"KV pool exhausted: {self.capacity - self.used} tokens free")
        for req, num in wants:
            self.reserve(req, num)

    def share_prefix(self, req: InferReq) -> int:
        """No prefix cache: nothing to share."""
        return 0

    def pause(self, req: InferReq) -> None:
        """Give every token back; the request recomputes from position 0."""
        self._give_back(req)

    def resume(self, req: InferReq) -> None:
        """Nothing to re-attach without a prefix cache."""

    def release(self, req: InferReq) -> None:
        """Give every token back."""
        self._give_back(req)

    def _give_back(self, req: InferReq) -> None:
        self.used -= req.kv_slot_len
        req.kv_slot_len = 0
        req.cur_kv_len = 0
