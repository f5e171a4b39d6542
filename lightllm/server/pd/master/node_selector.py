"""Placement: which serving node of a role gets the master's next request.

Load is what a node reported with its last heartbeat (:class:`~lightllm.server.pd.protocol.membership.NodeLoad`)
plus what the master placed on it since that report and has not yet seen leave it: the report
cannot know about those requests, and without them every request of a burst between two
heartbeats would go to the same node.  A placement made before a report counts no more (the
report includes it); one made after counts until it is released (the prefill node handed the
KV off, the decode node's segment ended, or the request failed).  A node that has not reported
yet counts as empty.  Nodes in state ``draining`` get nothing new, except a continuation segment
(its client is already streaming) when no serving node of the role is left: a draining node
still takes those within its graceful period (``continuation=True``).

Prefill (P): the fewest queued prefill tokens (``queued_prefill_tokens`` plus the prompt tokens
placed since), with prefix affinity: a prompt of at least :data:`AFFINITY_PREFIX_TOKENS` tokens
prefers the P that rendezvous hashing of its first :data:`AFFINITY_PREFIX_TOKENS` tokens names
among the serving P nodes, so prompts that share that prefix meet the same prefix cache; the
preferred P is kept while its queue exceeds the least loaded one's by at most
:data:`AFFINITY_QUEUE_MARGIN_TOKENS`, else the least loaded P is used.  Rendezvous hashing moves
only the prefixes of a node that joins or leaves; the others keep their P.

Decode (D): the most free KV (``free_kv_tokens`` minus the KV placed since; an unreported node
counts as empty: the largest ``kv_capacity_tokens`` any decode node reported, or unbounded when
none did), then the fewest running requests (``running_requests`` plus the requests placed
since).  Nodes to ``avoid`` (a continuation's previous D that ran out of KV) come last.

Ties go round robin in node-id order (a turn counter per role), so the choice is deterministic
for a given history, which tests rely on.
"""

from __future__ import annotations

import hashlib
import itertools
from array import array
from dataclasses import dataclass, field
from typing import Collection, Dict, List, Optional, Sequence, Union

from lightllm.server.manager_errors import ServerUnavailableError
from lightllm.server.pd.master.node_registry import NOT_READY_CODE, NodeRegistry
from lightllm.server.pd.protocol.node_info import DECODE, PREFILL, NodeInfo

# Prompts agreeing on this many leading tokens are sent to the same P (the default of
# --pd_prefix_affinity_tokens).  Long enough that a chat
# template plus a short default system prompt (tens of tokens) does not pull unrelated requests
# together; short enough that the prefixes worth sharing (long system prompts, few-shot
# examples, earlier turns of a conversation: hundreds to thousands of tokens) are caught.
# Shorter prompts get no affinity: their possible cache hit is worth less than balancing them.
AFFINITY_PREFIX_TOKENS = 256

# How many more queued prefill tokens the preferred P may have than the least loaded one before
# a prompt leaves it.  A cache hit saves a request at most its shared prefix (typically 1-4K
# tokens); waiting behind more extra work than that costs it more than the hit saves, and a
# larger margin would let one popular prefix pile its traffic onto a single P.
AFFINITY_QUEUE_MARGIN_TOKENS = 2048


@dataclass
class NodeEstimate:
    """A node's load as the placement sees it (report plus what was placed since)."""

    queued_prefill_tokens: int
    free_kv_tokens: float  # float: unbounded (inf) for a node of unknown capacity
    running_requests: int
    in_flight: int


@dataclass(eq=False)
class Placement:
    """One request placed on one node; :meth:`release` when it no longer loads the node."""

    selector: "NodeSelector"
    node_id: str
    prompt_tokens: int
    kv_tokens: int
    version: int
    ticket: int
    released: bool = False

    def release(self) -> None:
        """The request left the node (idempotent)."""
        if not self.released:
            self.released = True
            self.selector._release(self)


@dataclass
class _SinceReport:
    """What was placed on a node after its report ``version`` and is still there."""

    version: int
    prompt_tokens: int = 0
    kv_tokens: int = 0
    requests: int = 0


@dataclass
class _NodeBook:
    open: Dict[int, Placement] = field(default_factory=dict)
    since: Optional[_SinceReport] = None


def prefix_key(prompt_ids: Sequence[int], tokens: int = AFFINITY_PREFIX_TOKENS) -> Optional[bytes]:
    """The digest of a prompt's first ``tokens`` tokens, or None when it is shorter (no affinity)."""
    if tokens <= 0 or len(prompt_ids) < tokens:
        return None
    return hashlib.blake2b(array("q", prompt_ids[:tokens]).tobytes(), digest_size=16).digest()


def rendezvous_choice(key: bytes, nodes: Sequence[NodeInfo]) -> NodeInfo:
    """The node with the highest hash of (``key``, node id): stable while that node stays."""
    return max(nodes, key=lambda info: hashlib.blake2b(key + info.node_id.encode(), digest_size=8).digest())


class NodeSelector:
    """Places requests on serving nodes by reported load, placements since, prefix affinity.

    Call :meth:`place` (or :meth:`pick` then :meth:`acquire`, with no await in between) when a
    request is sent to a node and release the returned :class:`Placement` when it leaves that
    node.  A dropped node's placements are forgotten by :meth:`forget` (register it with
    ``registry.add_drop_listener``).
    """

    def __init__(self, registry: NodeRegistry, affinity_prefix_tokens: int = AFFINITY_PREFIX_TOKENS,
                 affinity_margin_tokens: int = AFFINITY_QUEUE_MARGIN_TOKENS) -> None:
        if affinity_prefix_tokens < 0 or affinity_margin_tokens < 0:
            raise ValueError("affinity_prefix_tokens and affinity_margin_tokens must be >= 0")
        self.registry = registry
        self.affinity_prefix_tokens = affinity_prefix_tokens
        self.affinity_margin_tokens = affinity_margin_tokens
        self._books: Dict[str, _NodeBook] = {}
        self._turn: Dict[str, int] = {}
        self._tickets = itertools.count(1)

    # --- choosing -------------------------------------------------------------------------
    def candidates(self, role: str, exclude: Collection[str] = (), continuation: bool = False) -> List[NodeInfo]:
        """Serving ``role`` nodes not in ``exclude``, sorted by node id; for a ``continuation``
        segment, when no node of the role serves at all, the draining ones not in ``exclude``.

        A serving node that is only excluded (it answered busy) keeps the draining ones out: the
        master told them they wait for no continuation (``continuations_pending`` 0), so they
        may be gone by now, and the busy policy waits for the serving one instead.
        """
        serving = self.registry.serving(role)
        if continuation and not serving:
            return [info for info in self.registry.draining(role) if info.node_id not in exclude]
        return [info for info in serving if info.node_id not in exclude]

    def pick(self, role: str, exclude: Collection[str] = (), prompt_ids: Optional[Sequence[int]] = None,
             avoid: Collection[str] = (), continuation: bool = False) -> NodeInfo:
        """The serving ``role`` node to use next, skipping node ids in ``exclude`` (a draining one
        for a ``continuation`` segment when no serving one is left, see :meth:`candidates`).

        ``prompt_ids`` (prefill) enables prefix affinity; ``avoid`` (decode) ranks those nodes
        last.  Raises ``ServerUnavailableError`` (code ``pd_not_ready``) when no node qualifies.
        """
        nodes = self.candidates(role, exclude, continuation)
        if not nodes:
            raise self._none_serving(role, exclude)
        turn = self._turn.get(role, 0)
        self._turn[role] = turn + 1
        # Rotating the node-id order by the role's turn makes min() break ties round robin.
        order = nodes[turn % len(nodes):] + nodes[: turn % len(nodes)]
        empty_kv = self._empty_kv_tokens() if role == DECODE else float("inf")
        estimates = {info.node_id: self.estimate(info.node_id, empty_kv) for info in nodes}
        if role == PREFILL:
            least = min(order, key=lambda info: estimates[info.node_id].queued_prefill_tokens)
            key = prefix_key(prompt_ids, self.affinity_prefix_tokens) if prompt_ids is not None else None
            if key is None or len(nodes) == 1:
                return least
            preferred = rendezvous_choice(key, nodes)
            extra = estimates[preferred.node_id].queued_prefill_tokens - estimates[least.node_id].queued_prefill_tokens
            return preferred if extra <= self.affinity_margin_tokens else least
        return min(order, key=lambda info: (info.node_id in avoid, -estimates[info.node_id].free_kv_tokens,
                                            estimates[info.node_id].running_requests))

    def place(self, role: str, prompt_ids: Sequence[int], kv_tokens: int, exclude: Collection[str] = (),
              avoid: Collection[str] = (), continuation: bool = False) -> Placement:
        """:meth:`pick` a node and :meth:`acquire` it for a request of ``prompt_ids``.

        ``kv_tokens``: the KV a decode node reserves for it (prompt plus tokens to generate).
        """
        node = self.pick(role, exclude, prompt_ids if role == PREFILL else None, avoid, continuation)
        if role == PREFILL:
            return self.acquire(node, prompt_tokens=len(prompt_ids))
        return self.acquire(node, kv_tokens=kv_tokens)

    def _none_serving(self, role: str, exclude: Collection[str]) -> ServerUnavailableError:
        if not exclude and not self.registry.ready:
            # The cluster is not ready: the same answer /health and a request arriving now get.
            return self.registry.not_ready_error()
        others = " other than " + ", ".join(sorted(exclude)) if exclude else ""
        alive = [info.node_id for info in self.registry.alive(role) if info.node_id not in exclude]
        if not alive:
            return ServerUnavailableError(f"no {role} node{others} is alive in the PD cluster", NOT_READY_CODE)
        return ServerUnavailableError(
            f"no {role} node{others} takes new requests in the PD cluster ({self.registry.why_not_serving(alive)})",
            NOT_READY_CODE)

    # --- accounting -----------------------------------------------------------------------
    def _book(self, node_id: str) -> _NodeBook:
        # The registry first: its lazy expiry may drop (and so forget) nodes.
        state = self.registry.state(node_id)
        book = self._books.get(node_id)
        if book is None:
            book = self._books[node_id] = _NodeBook()
        version = state.load_version if state is not None else 0
        if book.since is None or book.since.version != version:
            # A newer report includes everything placed before it.
            book.since = _SinceReport(version)
        return book

    def acquire(self, node: NodeInfo, prompt_tokens: int = 0, kv_tokens: int = 0) -> Placement:
        """Count one more request on ``node`` (``prompt_tokens`` to prefill, ``kv_tokens`` to hold)."""
        book = self._book(node.node_id)
        since = book.since
        assert since is not None
        placement = Placement(self, node.node_id, prompt_tokens, kv_tokens, since.version, next(self._tickets))
        book.open[placement.ticket] = placement
        since.prompt_tokens += prompt_tokens
        since.kv_tokens += kv_tokens
        since.requests += 1
        return placement

    def release(self, target: Union[Placement, NodeInfo]) -> None:
        """Release a placement, or (given a node) the node's most recent open placement."""
        if isinstance(target, Placement):
            target.release()
            return
        book = self._books.get(target.node_id)
        if book is not None and book.open:
            book.open[max(book.open)].release()

    def _release(self, placement: Placement) -> None:
        book = self._books.get(placement.node_id)
        if book is None or book.open.pop(placement.ticket, None) is None:
            return  # the node was forgotten (dropped) meanwhile
        since = book.since
        if since is not None and since.version == placement.version:
            since.prompt_tokens -= placement.prompt_tokens
            since.kv_tokens -= placement.kv_tokens
            since.requests -= 1

    def forget(self, node: NodeInfo, reason: str = "") -> None:
        """Drop ``node``'s placements (matches the registry's drop-listener signature)."""
        self._books.pop(node.node_id, None)

    # --- reading --------------------------------------------------------------------------
    def in_flight(self, node_id: str) -> int:
        """Requests the master has placed on ``node_id`` and not yet seen leave it."""
        book = self._books.get(node_id)
        return len(book.open) if book is not None else 0

    def estimate(self, node_id: str, empty_kv: Optional[float] = None) -> NodeEstimate:
        """``node_id``'s load as placement sees it (a node without a report counts as empty;
        ``empty_kv``: the free KV of an empty decode node, computed when None)."""
        book = self._book(node_id)
        since = book.since
        assert since is not None
        state = self.registry.state(node_id)
        load = state.load if state is not None else None
        queued = (load.queued_prefill_tokens or 0) if load is not None else 0
        running = (load.running_requests or 0) if load is not None else 0
        free: float
        if load is not None and load.free_kv_tokens is not None:
            free = load.free_kv_tokens
        else:
            free = empty_kv if empty_kv is not None else self._empty_kv_tokens()
        return NodeEstimate(queued + since.prompt_tokens, free - since.kv_tokens, running + since.requests,
                            len(book.open))

    def _empty_kv_tokens(self) -> float:
        # An empty decode node of the same model most likely has the capacity its peers report.
        capacities = []
        for info in self.registry.alive(DECODE):
            state = self.registry.state(info.node_id)
            if state is not None and state.load is not None and state.load.kv_capacity_tokens is not None:
                capacities.append(state.load.kv_capacity_tokens)
        return float(max(capacities)) if capacities else float("inf")
