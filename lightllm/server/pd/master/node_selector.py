"""Which alive node of a role gets the master's next request: the least loaded one.

Load is what the master itself knows for sure: the requests it has dispatched to a node and
not yet seen end.  Among equally loaded nodes the choice rotates round robin (in node-id
order), so the choice is deterministic for a given history, which tests rely on.
"""

from __future__ import annotations

from typing import Collection, Dict

from lightllm.server.pd.protocol.node_info import NodeInfo
from lightllm.server.pd.master.node_registry import NOT_READY_CODE, NodeRegistry
from lightllm.server.manager_errors import ServerUnavailableError


class NodeSelector:
    """Least in-flight requests first, round robin among ties.

    Call :meth:`acquire` when a request is sent to the chosen node and :meth:`release` when it
    ends there (finished, failed or moved to the next segment).  A dropped node's count is
    forgotten by :meth:`forget` (register it with ``registry.add_drop_listener``).
    """

    def __init__(self, registry: NodeRegistry) -> None:
        self.registry = registry
        self._in_flight: Dict[str, int] = {}
        self._turn: Dict[str, int] = {}

    def pick(self, role: str, exclude: Collection[str] = ()) -> NodeInfo:
        """The alive ``role`` node to use next, skipping node ids in ``exclude``.

        Raises ``ServerUnavailableError`` (code ``pd_not_ready``) when no such node is alive.
        """
        nodes = [info for info in self.registry.alive(role) if info.node_id not in exclude]
        if not nodes:
            others = " other than " + ", ".join(sorted(exclude)) if exclude else ""
            raise ServerUnavailableError(f"no {role} node{others} is alive in the PD cluster", NOT_READY_CODE)
        turn = self._turn.get(role, 0)
        # Rotate the tie order by the role's turn counter, then take the least loaded node.
        order = nodes[turn % len(nodes):] + nodes[: turn % len(nodes)]
        choice = min(order, key=lambda info: self._in_flight.get(info.node_id, 0))
        self._turn[role] = turn + 1
        return choice

    def acquire(self, node: NodeInfo) -> None:
        """Count one more request in flight on ``node``."""
        self._in_flight[node.node_id] = self._in_flight.get(node.node_id, 0) + 1

    def release(self, node: NodeInfo) -> None:
        """Count one request less in flight on ``node`` (never below zero)."""
        count = self._in_flight.get(node.node_id, 0)
        if count <= 1:
            self._in_flight.pop(node.node_id, None)
        else:
            self._in_flight[node.node_id] = count - 1

    def in_flight(self, node_id: str) -> int:
        """Requests the master has in flight on ``node_id``."""
        return self._in_flight.get(node_id, 0)

    def forget(self, node: NodeInfo, reason: str = "") -> None:
        """Drop ``node``'s count (matches the registry's drop-listener signature)."""
        self._in_flight.pop(node.node_id, None)
