"""How a node joins the master: the membership endpoints, their refusal code, the heartbeat defaults
and the load and state a node reports; and the paths of the node control endpoints the master calls.

Both sides read these: the master serves the paths (:mod:`lightllm.server.pd.master.membership_api`)
and expires silent nodes by the heartbeat rule; a node's registration client calls the paths and
heartbeats at the interval the master expects.

A heartbeat body is ``{"node_id": str}`` plus, optionally, ``"load"`` (a :class:`NodeLoad` as a
JSON object) and ``"state"`` (one of :data:`NODE_STATES`); a registration body may carry the same
two keys next to the :class:`~.node_info.NodeInfo` fields.  A node that sends neither (an older
node) is placed as an empty, serving node.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, fields
from typing import Any, Dict, Optional, Tuple

from lightllm.server.run_mode import RunMode

REGISTER_PATH = "/pd/register"
HEARTBEAT_PATH = "/pd/heartbeat"
NODES_PATH = "/pd/nodes"
# A draining node that stops says so on its way out (body ``{"node_id": str}``), so it leaves the
# master's list and counts at once instead of after the missed heartbeats.
DEREGISTER_PATH = "/pd/deregister"

# The error code of a heartbeat from a node the master does not know (it restarted or dropped
# the node): the node registers again.
UNKNOWN_NODE_CODE = "unknown_node"

DEFAULT_HEARTBEAT_INTERVAL_S = 2.0
DEFAULT_MAX_MISSED_HEARTBEATS = 3

# Heartbeat intervals a node waits beyond the master's own bound before it counts the master
# lost.  The master drops a node after ``interval x count`` without its heartbeat; were the node
# to give up on the master after the same silence, one stall of the master's own (its heartbeats
# unanswered: a blocked loop, a process starved of CPU) would make every node end its requests
# at the moment the master, which does not count its own stalls, still keeps them.
MASTER_SILENCE_EXTRA_BEATS = 2


def master_silence_bound_s(heartbeat_interval_s: float, max_missed_heartbeats: int) -> float:
    """Seconds of an unanswering master after which a node counts it lost (10 s by default)."""
    return heartbeat_interval_s * (max_missed_heartbeats + MASTER_SILENCE_EXTRA_BEATS)


# The node control endpoints the master calls (served by lightllm.server.pd.node.api), named once
# here so the master's client and the node's routes cannot drift apart.
# ``{"epoch", "peer_node_id", "prefill_transfer_address"}`` -> ``{"epoch"}`` once rank 0 applied it.
TRANSFER_SETUP_PATH = "/pd/node/transfer_setup"
# The master -> node call that drops one transfer pair's handles (its other node left):
# ``{"epoch": E}`` -> 200 ``{"epoch": E, "known": bool}``, idempotent.
TRANSFER_TEARDOWN_PATH = "/pd/node/transfer_teardown"
# One segment of a request, answered with an NDJSON stream (protocol.stream_lines); each role
# serves its own path only.
DECODE_PATH = "/pd/node/decode"
PREFILL_PATH = "/pd/node/prefill"
ROLE_PATHS: Dict[str, str] = {RunMode.DECODE.value: DECODE_PATH, RunMode.PREFILL.value: PREFILL_PATH}

# The optional keys of a heartbeat (and registration) body.
LOAD_KEY = "load"
STATE_KEY = "state"

# The key of a registration/heartbeat answer to a draining node: how many generations in flight
# on the master may still send it a continuation segment (0: none; its drain may end once idle).
CONTINUATIONS_PENDING_KEY = "continuations_pending"

# A node's state: "serving" takes new requests; "draining" (it got SIGTERM) finishes what it
# holds and takes no new request, so the master places nothing new on it (only continuation
# segments of generations already streaming, when no serving node of its role is left).
STATE_SERVING = "serving"
STATE_DRAINING = "draining"
NODE_STATES: Tuple[str, ...] = (STATE_SERVING, STATE_DRAINING)


class MembershipBodyError(ValueError):
    """A ``load`` or ``state`` value the master refuses; ``param`` names the bad field."""

    def __init__(self, message: str, param: str):
        super().__init__(message)
        self.param = param


@dataclass(frozen=True)
class NodeLoad:
    """What a node reports of its own load with each heartbeat (None: not reported).

    Attributes:
        queued_prefill_tokens: prompt tokens waiting to be prefilled (a prefill node's queue).
        running_requests: requests the node holds (decoding, or queued/prefilling on P).
        free_kv_tokens: KV token slots neither used nor promised to a reservation.
        kv_capacity_tokens: all KV token slots of the node.
    """

    queued_prefill_tokens: Optional[int] = None
    running_requests: Optional[int] = None
    free_kv_tokens: Optional[int] = None
    kv_capacity_tokens: Optional[int] = None

    @classmethod
    def from_body(cls, value: Any) -> "NodeLoad":
        """Parse a body's ``load`` object; :class:`MembershipBodyError` names a bad field.

        Known fields must be integers >= 0 (or absent / null).  Unknown keys are ignored on
        purpose: a newer node that reports more must still be able to heartbeat to this master,
        since a refused heartbeat would end with the healthy node being dropped.
        """
        if not isinstance(value, dict):
            raise MembershipBodyError(f"load must be a JSON object, got {type(value).__name__}", LOAD_KEY)
        parsed: Dict[str, Optional[int]] = {}
        for field in fields(cls):
            item = value.get(field.name)
            if item is not None and (isinstance(item, bool) or not isinstance(item, int) or item < 0):
                raise MembershipBodyError(f"load.{field.name} must be an integer >= 0, got {item!r}",
                                          f"{LOAD_KEY}.{field.name}")
            parsed[field.name] = item
        return cls(**parsed)

    def to_dict(self) -> Dict[str, Optional[int]]:
        """The JSON ``load`` object (round-trips through :meth:`from_body`)."""
        return asdict(self)


def parse_state(value: Any) -> str:
    """A body's ``state``: one of :data:`NODE_STATES`, else :class:`MembershipBodyError`."""
    if value not in NODE_STATES:
        raise MembershipBodyError(f"state must be one of {', '.join(NODE_STATES)}, got {value!r}", STATE_KEY)
    return value
