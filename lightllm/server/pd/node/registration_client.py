"""The node side of PD membership: register with the master, heartbeat, notice a dead master.

A prefill or decode node runs one :class:`PdNodeClient`. It registers (retrying while the master
is unreachable), then heartbeats at the interval the master sent back. Heartbeats go both ways:
every answered heartbeat proves the master alive, so when no registration or heartbeat has been
answered for ``master_timeout_s`` (default: :func:`master_silence_bound_s`, two intervals beyond
the master's own bound) the client calls ``on_master_lost`` once; the node can then fail the
requests the master sent it (a master that never answered yet is waited for with one warning:
the node may start first). When the master answers again (a restarted master says
``unknown_node``, and the client registers again) ``on_master_back`` is called. A master that
answers ``unknown_node`` (it dropped the node, say after the node hung, or it restarted) has
forgotten everything it set up with the node: the client awaits ``on_master_forgot`` before it
registers again, so the node can release what that membership held (its transfer pairs) before
the master sets up new ones. A refusal (incompatible node, id in use, invalid registration) is
final: the client stops and calls ``on_refused`` with the master's message, which names every
mismatched field.

Every registration and heartbeat carries what ``report`` returns (the node's ``"load"`` and
``"state"``, see :mod:`lightllm.server.pd.protocol.membership`).  A master of an older version
refuses fields it does not know with a 400 naming the field; the client then leaves them out
for that master (until it registers again, perhaps with an upgraded master) rather than losing
it.  :meth:`PdNodeClient.beat_now` sends the next heartbeat at once (a node that starts to
drain tells the master without waiting for the interval), and ``stop(leave=True)`` deregisters
a stopping node, so a drained node leaves the master's list at once.

A draining node's answers carry ``continuations_pending``: whether the master may still send the
node a continuation segment (:mod:`lightllm.server.pd.node.drain_continuations`);
:meth:`PdNodeClient.continuations_may_come` reads it, and a draining node heartbeats more often.
"""

from __future__ import annotations

import asyncio
import logging
import time
from typing import Any, Awaitable, Callable, Dict, Mapping, Optional

import httpx

from lightllm.server.http.middleware.auth import cluster_key_headers
from lightllm.server.pd.protocol.node_info import NodeInfo
from lightllm.server.pd.protocol.membership import (
    DEFAULT_HEARTBEAT_INTERVAL_S,
    DEREGISTER_PATH,
    DEFAULT_MAX_MISSED_HEARTBEATS,
    HEARTBEAT_PATH,
    REGISTER_PATH,
    STATE_KEY,
    UNKNOWN_NODE_CODE,
    master_silence_bound_s,
)
from lightllm.server.pd.node.drain_continuations import ContinuationsWatch
# NodeRegistrationRefused is imported from here too (the client raises it).
from lightllm.server.pd.node.master_answers import REPORT_FIELDS, NodeRegistrationRefused, error_of, refuses_report

logger = logging.getLogger(__name__)


# How long a stopping node waits for the master to take its deregistration: the stop must not
# hang on a master that does not answer (the silence rule drops the node then).
DEREGISTER_TIMEOUT_S = 2.0

class PdNodeClient:
    """Keeps one node registered with the PD master and tells its owner about the master's state.

    Args:
        master_url: ``http://host:port`` of the master.
        info: this node's registration.
        heartbeat_interval_s: pace of registration retries until the master answers; after
            that the master's interval is used.
        master_timeout_s: how long the master may stay silent before ``on_master_lost``; None:
            :func:`master_silence_bound_s` of the interval and count the master sent.
        on_master_lost / on_master_back: called (with a reason / without arguments) when the
            master becomes unreachable for longer than the bound, and when it answers again.
        on_refused: called with the refusal message when the master refuses the node.
        on_master_forgot: awaited (with the master's message) when the master answers that it does
            not know the node, before the node registers again.
        clock: time source (``time.monotonic``).
        cluster_key: the cluster's key (``--pd_cluster_key``), sent on every call.  A master
            that accepts the registration but has no key of its own would call this node's
            ``/pd/`` endpoints without it, so the node treats that answer as a refusal.
        report: returns the fields added to every registration and heartbeat body (``"load"``,
            ``"state"``); called on the event loop right before each call.  None: none added.
    """

    def __init__(
        self,
        master_url: str,
        info: NodeInfo,
        *,
        heartbeat_interval_s: float = DEFAULT_HEARTBEAT_INTERVAL_S,
        master_timeout_s: Optional[float] = None,
        on_master_lost: Optional[Callable[[str], None]] = None,
        on_master_back: Optional[Callable[[], None]] = None,
        on_refused: Optional[Callable[[str], None]] = None,
        on_master_forgot: Optional[Callable[[str], Awaitable[None]]] = None,
        clock: Callable[[], float] = time.monotonic,
        cluster_key: Optional[str] = None,
        report: Optional[Callable[[], Mapping[str, Any]]] = None,
    ) -> None:
        if not heartbeat_interval_s > 0:
            raise ValueError(f"heartbeat_interval_s must be > 0, got {heartbeat_interval_s!r}")
        if master_timeout_s is not None and not master_timeout_s > 0:
            raise ValueError(f"master_timeout_s must be > 0, got {master_timeout_s!r}")
        self.master_url = master_url.rstrip("/")
        self.info = info
        self.heartbeat_interval_s = float(heartbeat_interval_s)
        self._explicit_master_timeout = master_timeout_s
        self.master_timeout_s = master_timeout_s or master_silence_bound_s(heartbeat_interval_s,
                                                                           DEFAULT_MAX_MISSED_HEARTBEATS)
        self._on_master_lost = on_master_lost
        self._on_master_back = on_master_back
        self._on_refused = on_refused
        self._on_master_forgot = on_master_forgot
        self._forgotten: Optional[str] = None  # the master's unknown_node message, until handled
        self._clock = clock
        self._cluster_key = cluster_key
        self._report = report
        # Cleared when this master refuses the report fields on that call (an older master).
        self._report_on = {REGISTER_PATH: report is not None, HEARTBEAT_PATH: report is not None}
        self._report_failed = False
        self.registered = False
        self.master_lost = False
        # Until the master first answers there is nothing to lose: no request of it is open, and
        # a node may start before its master (it retries), so silence is waited for, not an error.
        self._ever_answered = False
        self._told_waiting = False
        self.master_id: Optional[str] = None
        self.refusal: Optional[NodeRegistrationRefused] = None
        self.registrations = 0
        self.heartbeats = 0
        self._last_answer = clock()
        self._registered_event = asyncio.Event()
        self._stop = asyncio.Event()
        # Ends the pause between beats early: set by stop() and beat_now().
        self._wake = asyncio.Event()
        # A beat_now() whose heartbeat has not started yet; stop() still sends it.
        self._beat_owed = False
        self._task: Optional[asyncio.Task] = None
        self._http: Optional[httpx.AsyncClient] = None
        # What the master's answers said of continuation segments still to come (draining).
        self.continuations = ContinuationsWatch()

    def continuations_may_come(self) -> bool:
        """Whether the master may still send this draining node a continuation segment.

        True until the master answered a heartbeat that said the node drains with
        ``continuations_pending`` 0; False once the master is lost (nothing would come) or the
        client stopped.  A node that does not drain gets no such answer: call it while draining.
        """
        if self.master_lost or self._stop.is_set() or self.refusal is not None or not self.registered:
            return False
        if not self._report_on[HEARTBEAT_PATH]:
            return False  # an older master: it learns no state, so it sends a draining node nothing
        return self.continuations.may_come()

    # --- lifecycle ------------------------------------------------------------------------
    def start(self) -> None:
        """Start registering and heartbeating on the running event loop."""
        if self._task is not None:
            raise RuntimeError("the PD node client is already running")
        self._last_answer = self._clock()
        self._http = httpx.AsyncClient(base_url=self.master_url, headers=cluster_key_headers(self._cluster_key),
                                       trust_env=False)
        self._task = asyncio.get_running_loop().create_task(self._run(), name=f"pd-node-{self.info.node_id}")

    async def wait_registered(self, timeout: float) -> None:
        """Wait until registered; raises the refusal, or ``TimeoutError`` after ``timeout`` s."""
        waiter = asyncio.ensure_future(self._registered_event.wait())
        try:
            await asyncio.wait_for(asyncio.shield(waiter), timeout)
        except asyncio.TimeoutError:
            message = f"{self.info.describe()} did not register with {self.master_url} in {timeout:g} s"
            raise TimeoutError(message) from None
        finally:
            waiter.cancel()
        if self.refusal is not None:
            raise self.refusal

    def beat_now(self) -> None:
        """Send the next heartbeat (or registration attempt) now instead of after the interval.

        Call on the client's event loop.  A beat already on its way does not count: another
        one follows it, so the master sees what ``report`` returns from now on.  A :meth:`stop`
        that comes first still sends it (a draining node stops soon after it asks).
        """
        self._beat_owed = True
        self._wake.set()

    async def stop(self, leave: bool = False) -> None:
        """Stop heartbeating and close the client.

        ``leave``: the node is stopping for good; a registered node then tells the master, which
        drops it at once if it reported ``draining`` (else after its silence bound, as a node
        that stopped without ``leave`` is).
        """
        self._stop.set()
        self._wake.set()
        task, self._task = self._task, None
        if task is not None:
            await task
        if leave and self.registered and self.refusal is None:
            await self._deregister()
        if self._http is not None:
            await self._http.aclose()
            self._http = None

    # --- the loop -------------------------------------------------------------------------
    async def _run(self) -> None:
        while not self._stop.is_set():
            # Beats keep their pace whatever the master's latency: sleep the rest of the interval.
            beat_started = time.monotonic()
            self._wake.clear()
            self._beat_owed = False
            register_now = False
            try:
                if self.registered:
                    register_now = await self._heartbeat()
                else:
                    await self._register()
            except NodeRegistrationRefused as refusal:
                self.refusal = refusal
                self._registered_event.set()  # wakes wait_registered, which raises the refusal
                logger.error("PD master refused %s: %s", self.info.describe(), refusal)
                self._notify(self._on_refused, str(refusal))
                return
            except (httpx.HTTPError, OSError) as exc:
                self._master_silent(f"{type(exc).__name__}: {exc}")
            except Exception as exc:  # noqa: BLE001 - a malformed answer must not end the heartbeats
                logger.exception("unexpected answer from PD master %s", self.master_url)
                self._master_silent(f"{type(exc).__name__}: {exc}")
            if register_now:
                await self._master_forgot()
                continue
            pause = self.continuations.interval(self.heartbeat_interval_s) - (time.monotonic() - beat_started)
            try:
                await asyncio.wait_for(self._wake.wait(), max(pause, 0.0))
            except asyncio.TimeoutError:
                pass
        if self._beat_owed and self.registered:
            self._beat_owed = False
            try:
                await self._heartbeat()
            except Exception as exc:  # noqa: BLE001 - stopping anyway; the master expires the node
                logger.warning("%s: last heartbeat to PD master %s failed: %s", self.info.describe(), self.master_url,
                               exc)

    async def _deregister(self) -> None:
        assert self._http is not None
        try:
            response = await self._http.post(DEREGISTER_PATH, json={"node_id": self.info.node_id},
                                             timeout=min(self.heartbeat_interval_s, DEREGISTER_TIMEOUT_S))
        except (httpx.HTTPError, OSError) as exc:
            logger.warning("%s: could not deregister from PD master %s (%s); it drops the node when its "
                           "heartbeats stop", self.info.describe(), self.master_url, exc)
            return
        if response.status_code != 200:
            # An older master has no such path (404): its silence rule drops the node instead.
            logger.info("%s: PD master %s did not take the deregistration (%s)", self.info.describe(),
                        self.master_url, error_of(response)[0])
            return
        body = response.json()
        logger.info("%s: %s", self.info.describe(), body.get("message") if isinstance(body, dict) else body)

    def _report_fields(self, path: str) -> Dict[str, Any]:
        if not self._report_on[path] or self._report is None:
            return {}
        try:
            fields = dict(self._report())
        except Exception:  # noqa: BLE001 - a failing report must not stop the heartbeats
            if not self._report_failed:
                logger.exception("%s: reading the node's load for the PD master failed; sending none",
                                 self.info.describe())
            self._report_failed = True
            return {}
        self._report_failed = False
        return {name: value for name, value in fields.items() if name in REPORT_FIELDS}

    async def _post(self, path: str, body: Dict[str, Any]) -> httpx.Response:
        """POST ``body`` plus the report fields; again without them if this master refuses them."""
        assert self._http is not None
        extra = self._report_fields(path)
        self.continuations.sent(extra.get(STATE_KEY))
        response = await self._http.post(path, json={**body, **extra}, timeout=self.heartbeat_interval_s)
        if refuses_report(response, extra):
            self._report_on[path] = False
            logger.warning("PD master %s does not take %s in %s (%s); leaving them out for this master",
                           self.master_url, ", ".join(sorted(extra)), path, error_of(response)[0])
            self.continuations.sent(None)
            response = await self._http.post(path, json=body, timeout=self.heartbeat_interval_s)
        return response

    async def _register(self) -> None:
        response = await self._post(REGISTER_PATH, self.info.to_dict())
        if response.status_code == 200:
            body = response.json()
            if self._cluster_key and not body.get("cluster_key"):
                # The master would call this node's /pd/ endpoints without the key it requires.
                raise NodeRegistrationRefused(
                    f"the PD master at {self.master_url} has no cluster key but this node has one: give the master "
                    f"the same key (--pd_cluster_key or LIGHTLLM_PD_CLUSTER_KEY)", "cluster_key_mismatch"
                )
            self._accepted(body)
            self.registered = True
            self.registrations += 1
            self._registered_event.set()
            logger.info("%s registered with PD master %s (master id %s)", self.info.describe(), self.master_url,
                        self.master_id)
            return
        message, code = error_of(response)
        if response.status_code in (404, 405) and code in (None, "not_found", "method_not_allowed"):
            # Something answers there, but it has no registration endpoint: another server.
            message = (f"{self.master_url} is not a PD master (it has no {REGISTER_PATH}: {message}); point "
                       "--pd_master_ip/--pd_master_port at the master's address and --port")
            code = "not_a_pd_master"
        if 400 <= response.status_code < 500:
            raise NodeRegistrationRefused(message, code)
        self._master_silent(message)

    async def _heartbeat(self) -> bool:
        """One heartbeat; True when the master does not know the node and it must register now."""
        response = await self._post(HEARTBEAT_PATH, {"node_id": self.info.node_id})
        if response.status_code == 200:
            self._accepted(response.json())
            self.heartbeats += 1
            return False
        message, code = error_of(response)
        if response.status_code == 404 and code == UNKNOWN_NODE_CODE:
            # The master answered, so it is alive; it lost us (restart, or it dropped us).
            self._answered()
            # A restarted master may be a newer one: offer it the report fields again.
            self._report_on = {path: self._report is not None for path in self._report_on}
            logger.warning("PD master %s does not know %s (%s); registering again", self.master_url,
                           self.info.describe(), message)
            self._forgotten = message
            self.registered = False
            self._registered_event.clear()
            return True
        self._master_silent(message)
        return False

    # --- master state ---------------------------------------------------------------------
    def _accepted(self, body: Dict[str, Any]) -> None:
        self._answered()
        self.continuations.answered(body)
        self.master_id = body.get("master_id")
        self.heartbeat_interval_s = float(body["heartbeat_interval_s"])
        if self._explicit_master_timeout is None:
            self.master_timeout_s = master_silence_bound_s(self.heartbeat_interval_s, int(body["max_missed_heartbeats"]))

    def _answered(self) -> None:
        self._last_answer = self._clock()
        self._ever_answered = True
        if self.master_lost:
            self.master_lost = False
            logger.info("PD master %s answers again", self.master_url)
            self._notify(self._on_master_back)

    def _master_silent(self, why: str) -> None:
        silent_for = self._clock() - self._last_answer
        if self.master_lost or silent_for <= self.master_timeout_s:
            return
        if not self._ever_answered:
            if not self._told_waiting:
                self._told_waiting = True
                logger.warning("%s: waiting for the PD master %s, which has not answered yet (%s); still retrying",
                               self.info.describe(), self.master_url, why)
            return
        self.master_lost = True
        reason = f"the PD master {self.master_url} has not answered for {silent_for:.1f} s (last error: {why})"
        logger.error("%s: %s", self.info.describe(), reason)
        self._notify(self._on_master_lost, reason)

    async def _master_forgot(self) -> None:
        message, self._forgotten = self._forgotten, None
        if self._on_master_forgot is None or message is None:
            return
        try:
            await self._on_master_forgot(message)
        except Exception:  # noqa: BLE001 - the owner's bug must not stop the registration
            logger.exception("PD node client callback failed")

    def _notify(self, callback: Optional[Callable[..., None]], *args: Any) -> None:
        if callback is None:
            return
        try:
            callback(*args)
        except Exception:  # noqa: BLE001 - the owner's bug must not stop the heartbeats
            logger.exception("PD node client callback failed")
