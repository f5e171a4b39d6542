"""The PD master's set of live prefill and decode nodes.

Membership rules:

* A node joins with :meth:`NodeRegistry.register`.  It must agree with the nodes already alive
  on every :data:`~.node_info.COMPATIBILITY_FIELDS` field; while no node is alive the first one
  to register sets the reference.  A refusal names every mismatched field.
* A node then heartbeats every ``heartbeat_interval_s`` seconds (default
  :data:`~lightllm.server.pd.protocol.membership.DEFAULT_HEARTBEAT_INTERVAL_S` = 2 s).  A node not heard from for
  ``max_missed_heartbeats`` intervals (default :data:`DEFAULT_MAX_MISSED_HEARTBEATS` = 3, so
  6 s) is dropped: it leaves the live set and every drop listener is told, so the master can
  fail that node's in-flight requests.  With the expiry sweeper checking every half interval,
  a silent node is dropped at most ``interval * (missed + 0.5)`` seconds (7 s by default) after
  its last heartbeat.
* Heartbeats (and the registration) may carry the node's ``load`` and ``state``
  (:mod:`lightllm.server.pd.protocol.membership`); the registry keeps the last of each.  A
  heartbeat without them keeps what was reported before; a node that never reports counts as
  empty and serving (older nodes).  Every load report bumps the node's ``load_version``, which
  lets the placement tell what it sent before a report (counted in it) from what it sent after.
* The cluster is ready when at least one prefill and one decode node are alive and serving
  (not draining): a draining node takes no new requests (only continuation segments of
  generations already streaming, when no serving node of its role is left: :meth:`NodeRegistry.draining`).

Both numbers are constructor arguments; they will become the flags ``--pd_heartbeat_interval``
and ``--pd_max_missed_heartbeats`` of :mod:`lightllm.server.launch.arg_parser` when the PD run modes are
wired (configuration has one source, the argument parser).  The master sends both values to
every node in its registration answer, so the nodes heartbeat at the master's pace.

Time comes from an injected ``clock`` (``time.monotonic`` by default), so tests move time
without sleeping.  The registry is not thread-safe: use it from the master's event loop.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass
from typing import Callable, Dict, List, Optional

from lightllm.server.pd.protocol.node_info import (
    DECODE,
    PREFILL,
    ROLES,
    NodeInfo,
    compatibility_mismatches,
)
from lightllm.server.manager_errors import ServerUnavailableError
from lightllm.server.pd.master.stall_watch import MasterStallWatch
from lightllm.server.pd.protocol.membership import (
    DEFAULT_HEARTBEAT_INTERVAL_S,
    DEFAULT_MAX_MISSED_HEARTBEATS,
    STATE_DRAINING,
    STATE_SERVING,
    NodeLoad,
)

logger = logging.getLogger(__name__)

# The ServerUnavailableError code of a request that arrives while the cluster is not ready.
NOT_READY_CODE = "pd_not_ready"

DropListener = Callable[[NodeInfo, str], None]
# Extra admission rules of the owner (the master's served model): one problem per line, [] = admit.
AdmissionCheck = Callable[[NodeInfo], List[str]]


class RegistrationRefused(ValueError):
    """The master will not admit a node; ``reasons`` lists each problem, ``code`` classifies it.

    Codes: ``incompatible_node`` (a compatibility field differs from the live nodes') and
    ``node_id_in_use`` (another live node, at a different address or role, has this id).
    """

    def __init__(self, message: str, code: str, reasons: List[str]):
        super().__init__(message)
        self.code = code
        self.reasons = reasons


@dataclass
class NodeState:
    """A live node as the registry tracks it (times are readings of the registry's clock).

    ``load`` is the last load report (None: never reported), ``load_at`` when it came and
    ``load_version`` how many reports came; ``state`` is ``serving`` or ``draining``;
    ``refused_at`` when its HTTP port last refused a connection, None once it heartbeats again.
    """

    info: NodeInfo
    registered_at: float
    last_heartbeat: float
    heartbeats: int = 0
    load: Optional[NodeLoad] = None
    load_at: Optional[float] = None
    load_version: int = 0
    state: str = STATE_SERVING
    refused_at: Optional[float] = None

    @property
    def serving(self) -> bool:
        """The node takes new requests: it is not draining and its port did not refuse the master."""
        return self.state != STATE_DRAINING and self.refused_at is None



class NodeRegistry:
    """Live prefill/decode nodes: registration, heartbeats, expiry, readiness, drop events."""

    def __init__(
        self,
        heartbeat_interval_s: float = DEFAULT_HEARTBEAT_INTERVAL_S,
        max_missed_heartbeats: int = DEFAULT_MAX_MISSED_HEARTBEATS,
        clock: Callable[[], float] = time.monotonic,
        on_drop: Optional[DropListener] = None,
        admission: Optional[AdmissionCheck] = None,
    ) -> None:
        if not heartbeat_interval_s > 0:
            raise ValueError(f"heartbeat_interval_s must be > 0, got {heartbeat_interval_s!r}")
        missed = max_missed_heartbeats
        if isinstance(missed, bool) or not isinstance(missed, int) or missed < 1:
            raise ValueError(f"max_missed_heartbeats must be a positive integer, got {max_missed_heartbeats!r}")
        self.heartbeat_interval_s = float(heartbeat_interval_s)
        self.max_missed_heartbeats = max_missed_heartbeats
        self._clock = clock
        self._nodes: Dict[str, NodeState] = {}
        self._drop_listeners: List[DropListener] = [on_drop] if on_drop is not None else []
        self._admission = admission
        self.stall_watch: Optional[MasterStallWatch] = None  # set once a sweeper checks (watch_for_stalls)

    # --- configuration --------------------------------------------------------------------
    @property
    def expiry_s(self) -> float:
        """Seconds without a heartbeat after which a node is dropped."""
        return self.heartbeat_interval_s * self.max_missed_heartbeats

    def add_drop_listener(self, listener: DropListener) -> None:
        """Call ``listener(node_info, reason)`` whenever a node leaves the live set."""
        self._drop_listeners.append(listener)

    # --- membership -----------------------------------------------------------------------
    def register(self, info: NodeInfo, load: Optional[NodeLoad] = None, node_state: Optional[str] = None) -> NodeState:
        """Admit ``info`` or raise :class:`RegistrationRefused` naming every mismatched field.

        A node that registers again under its live id (same role and address) has restarted:
        its previous incarnation is dropped first (listeners fail its in-flight requests).
        ``load`` / ``node_state``: what the registration body reported (None: nothing).
        """
        self.expire()
        known = self._nodes.get(info.node_id)
        if known is not None and (known.info.role, known.info.http_address) != (info.role, info.http_address):
            reason = (
                f"node id {info.node_id!r} is already used by the live {known.info.describe()}; "
                f"refusing {info.role} node at {info.http_address}"
            )
            logger.warning("PD registration refused: %s", reason)
            raise RegistrationRefused(reason, "node_id_in_use", [reason])
        problems = self._admission(info) if self._admission is not None else []
        if problems:
            message = f"{info.describe()} cannot join this PD master: {'; '.join(problems)}"
            logger.warning("PD registration refused: %s", message)
            raise RegistrationRefused(message, "incompatible_node", problems)
        others = [state.info for node_id, state in self._nodes.items() if node_id != info.node_id]
        if others:
            # Alive nodes agree with one another: any is the reference, best one with a weights digest.
            reference = next((other for other in others if other.checkpoint_fingerprint), others[0])
            mismatches = compatibility_mismatches(reference, info)
            if mismatches:
                message = (
                    f"{info.describe()} is incompatible with the cluster (reference: {reference.describe()}); "
                    f"prefill and decode nodes must agree on model_name, dtype, num_layers, num_kv_heads, "
                    f"head_dim, tp_size, their weights (checkpoint_fingerprint) and logprobs_mode; mismatched: {'; '.join(mismatches)}"
                )
                logger.warning("PD registration refused: %s", message)
                raise RegistrationRefused(message, "incompatible_node", mismatches)
        if known is not None:
            self._drop(known, "it registered again (the node restarted)")
        now = self._clock()
        state = NodeState(info, registered_at=now, last_heartbeat=now)
        self._nodes[info.node_id] = state
        self._report(state, load, node_state)
        # Only a prefill node hosts transfer groups; a decode node's address is empty, and the log
        # read "kv transfer at )" for every one of them.
        transfer = f", kv transfer at {info.kv_transfer_address}" if info.role == PREFILL else ""
        logger.info("PD %s registered (model %s, dtype %s, tp %d%s)", info.describe(),
                    info.model_name, info.dtype, info.tp_size, transfer)
        return state

    def heartbeat(self, node_id: str, load: Optional[NodeLoad] = None, node_state: Optional[str] = None) -> bool:
        """Record a heartbeat and what it reported; False when the node is unknown (never
        registered, or dropped).  ``load`` / ``node_state`` None keep the last report."""
        self.expire()
        state = self._nodes.get(node_id)
        if state is None:
            return False
        state.last_heartbeat = self._clock()
        state.heartbeats += 1
        if state.refused_at is not None:
            state.refused_at = None
            logger.info("PD %s heartbeats again after refusing a connection; it takes new requests", state.info.describe())
        self._report(state, load, node_state)
        return True

    def mark_refused(self, node: NodeInfo, why: str) -> None:
        """The node's HTTP port refused a connection (nothing listens there, so its process is gone), or
        the node answered that it is failing or stopping.

        It takes no new requests and counts against readiness at once, instead of until it misses
        its heartbeats (7 s by default), in which every request placed on it failed while /health
        said ok; its next heartbeat (a node that only restarted its listener) takes it back. What
        runs on it is left to the calls that fail, as before: this drops nothing.
        """
        state = self._nodes.get(node.node_id)
        if state is None or state.refused_at is not None:
            return
        state.refused_at = self._clock()
        logger.warning("PD %s takes no new requests until it heartbeats again: %s", node.describe(), why)

    def _report(self, state: NodeState, load: Optional[NodeLoad], node_state: Optional[str]) -> None:
        if load is not None:
            state.load = load
            state.load_at = self._clock()
            state.load_version += 1
        if node_state is not None and node_state != state.state:
            logger.info("PD %s is now %s", state.info.describe(), node_state)
            state.state = node_state

    def unregister(self, node_id: str, reason: str) -> bool:
        """Drop a node now (it left, or the master gave up on it); False when it was not live."""
        state = self._nodes.get(node_id)
        if state is None:
            return False
        self._drop(state, reason)
        return True

    def leave(self, node_id: str) -> Optional[str]:
        """Drop a node that says it is stopping; None when dropped, else why it was not.

        Only a node that reported ``draining`` leaves this way: every node drains before it
        stops, and a node restarted under the same id (its new incarnation registers as serving,
        replacing the old one) must not be dropped by the old process's farewell.
        """
        state = self._nodes.get(node_id)
        if state is None:
            return f"node {node_id!r} is not registered with this master"
        if state.state != STATE_DRAINING:
            return (f"{state.info.describe()} is {state.state}, not draining: a node leaves only after it "
                    "drained (a restarted node's new incarnation stays)")
        self._drop(state, "it stopped (it deregistered on its way out)")
        return None

    def watch_for_stalls(self, sweep_period_s: float) -> None:
        """A sweeper now checks expiry every ``sweep_period_s``: silence while the master did not run is not counted.

        From then on every check first adds the master's own stall since the last check
        (:class:`~.stall_watch.MasterStallWatch`) to every node's last heartbeat.
        """
        self.stall_watch = MasterStallWatch(sweep_period_s, self._clock)

    def expire(self) -> List[NodeInfo]:
        """Drop every node silent for longer than :attr:`expiry_s`; returns the dropped nodes.

        Silence while the master itself did not run is not counted (:meth:`watch_for_stalls`).
        """
        now = self._clock()
        stalled = self.stall_watch.stall_before(now) if self.stall_watch is not None else 0.0
        if stalled:
            for state in self._nodes.values():
                state.last_heartbeat += stalled
        silent = [state for state in self._nodes.values() if now - state.last_heartbeat > self.expiry_s]
        for state in silent:
            self._drop(
                state,
                f"it missed {self.max_missed_heartbeats} heartbeats (none for {now - state.last_heartbeat:.1f} s; "
                f"interval {self.heartbeat_interval_s:g} s)",
            )
        return [state.info for state in silent]

    def _drop(self, state: NodeState, reason: str) -> None:
        if self._nodes.get(state.info.node_id) is not state:
            return  # a listener's own query already expired it
        del self._nodes[state.info.node_id]
        logger.warning("PD %s dropped: %s", state.info.describe(), reason)
        for listener in list(self._drop_listeners):
            try:
                listener(state.info, reason)
            except Exception:  # noqa: BLE001 - one failing listener must not keep a dead node alive
                logger.exception("PD drop listener failed for %s", state.info.describe())

    # --- queries --------------------------------------------------------------------------
    def get(self, node_id: str) -> Optional[NodeInfo]:
        """The live node with this id, or None."""
        self.expire()
        state = self._nodes.get(node_id)
        return state.info if state is not None else None

    def alive(self, role: Optional[str] = None) -> List[NodeInfo]:
        """Live nodes (of ``role`` when given), sorted by node id."""
        if role is not None and role not in ROLES:
            raise ValueError(f"role must be one of {', '.join(ROLES)}, got {role!r}")
        self.expire()
        return sorted(
            (state.info for state in self._nodes.values() if role is None or state.info.role == role),
            key=lambda info: info.node_id,
        )

    def state(self, node_id: str) -> Optional[NodeState]:
        """The live node's tracked state (registration, last load, serving or draining), or None."""
        self.expire()
        return self._nodes.get(node_id)

    def serving(self, role: str) -> List[NodeInfo]:
        """Live ``role`` nodes that take new requests (not draining, no refused connection since their
        last heartbeat), sorted by node id."""
        return [info for info in self.alive(role) if self._nodes[info.node_id].serving]

    def draining(self, role: str) -> List[NodeInfo]:
        """Live ``role`` nodes that drain (and whose port did not refuse the master), sorted by node id:
        they still take continuation segments of the generations admitted before."""
        return [info for info in self.alive(role)
                if self._nodes[info.node_id].state == STATE_DRAINING and self._nodes[info.node_id].refused_at is None]

    def missing(self) -> List[str]:
        """What keeps the cluster from being ready, e.g. ``["no decode node registered"]``."""
        problems = []
        for role in (PREFILL, DECODE):
            alive = self.alive(role)
            if not alive:
                problems.append(f"no {role} node registered")
            elif not any(self._nodes[info.node_id].serving for info in alive):
                ids = [info.node_id for info in alive]
                if any(self._nodes[node_id].refused_at is not None for node_id in ids):
                    problems.append(f"no {role} node takes new requests ({self.why_not_serving(ids)})")
                else:
                    problems.append(f"every {role} node is draining ({', '.join(ids)})")
        return problems

    def why_not_serving(self, node_ids: List[str]) -> str:
        """Why the live nodes ``node_ids`` (none :attr:`NodeState.serving`) take no new requests:
        ``"p0, p1 draining"``, or each node's reason once one refused a connection."""
        states = [self._nodes[node_id] for node_id in node_ids if node_id in self._nodes]
        if all(state.refused_at is None for state in states):
            return f"{', '.join(state.info.node_id for state in states)} draining"
        return ", ".join(f"{state.info.node_id} {'refused a connection' if state.refused_at is not None else 'draining'}"
                         for state in states)

    @property
    def ready(self) -> bool:
        """At least one prefill and one decode node are alive and serving."""
        return not self.missing()

    def not_ready_error(self) -> ServerUnavailableError:
        """The 503 (code ``pd_not_ready``) naming what keeps the cluster from being ready."""
        return ServerUnavailableError(f"The PD cluster is not ready: {'; '.join(self.missing())}", NOT_READY_CODE)

    def require_ready(self) -> None:
        """Raise :meth:`not_ready_error` unless the cluster is ready."""
        if not self.ready:
            raise self.not_ready_error()

    def snapshot(self) -> List[Dict[str, object]]:
        """Each live node's registration plus ``heartbeats``, ``last_heartbeat_age_s``, ``state``,
        ``load`` (the last report, None before the first), ``load_age_s``, ``refused_age_s``
        (seconds since its port refused the master, None when it did not since its last heartbeat)
        and ``serving`` (whether it takes new requests: ``state`` is the node's own last report,
        which a refused connection does not change)."""
        self.expire()
        now = self._clock()
        return [
            {
                **state.info.to_dict(),
                "heartbeats": state.heartbeats,
                "last_heartbeat_age_s": round(now - state.last_heartbeat, 3),
                "state": state.state,
                "load": state.load.to_dict() if state.load is not None else None,
                "load_age_s": round(now - state.load_at, 3) if state.load_at is not None else None,
                "refused_age_s": round(now - state.refused_at, 3) if state.refused_at is not None else None,
                "serving": state.serving,
            }
            for state in sorted(self._nodes.values(), key=lambda s: s.info.node_id)
        ]
