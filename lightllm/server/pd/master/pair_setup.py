"""The PD master's table of set-up prefill/decode pairs and their KV transfer setup.

KV moves from P's TP rank r to D's TP rank r over a two-rank group that P hosts at its
``kv_transfer_address`` port + r.  Every connected (P, D) pair has its own group, named by a
cluster-unique integer ``epoch`` the master never reuses.  A pair is set up on first use: the
first request placed on (P, D) makes the master ``POST P /pd/node/transfer_setup`` THEN
``POST D /pd/node/transfer_setup`` with a fresh epoch, under a lock of that pair only (two
requests never set one pair up twice; other pairs set up meanwhile).  The pair is then reused
while both nodes stay registered.

A pair is dropped when either node leaves the cluster or registers again (it restarted), and
when a node reports the pair's transfer broken (:meth:`PairSetup.invalidate`); the next request
placed on those nodes sets it up again under a new epoch.  The master tells the nodes to let go
of a dropped epoch with ``POST /pd/node/transfer_teardown {"epoch"}``: the surviving node when
the other one left, both nodes when the transfer broke, and the node already set up when a
setup failed half way.  Teardowns are best effort: they run in the background with a bound of
:data:`TEARDOWN_TIMEOUT_S`, and a failure is only logged (the node may be gone too; a live node
that missed one still holds an idle group, which costs it no pending collective).
"""

from __future__ import annotations

import asyncio
import logging
import time
from dataclasses import dataclass
from typing import Dict, Iterable, List, Optional, Set, Tuple

from lightllm.server.manager_errors import ServerUnavailableError
from lightllm.server.pd.master.node_registry import NodeRegistry
from lightllm.server.pd.master.node_streams import NodeCallError, NodeStreams
from lightllm.server.pd.protocol.membership import TRANSFER_SETUP_PATH, TRANSFER_TEARDOWN_PATH
from lightllm.server.pd.protocol.node_info import PREFILL, NodeInfo

logger = logging.getLogger(__name__)

SETUP_FAILED_CODE = "pd_transfer_setup_failed"

# A teardown only frees an idle group on a live node: it must never hold up the master (its
# stop waits for the teardowns still running) for longer than a connect plus a short answer.
TEARDOWN_TIMEOUT_S = 5.0

PairKey = Tuple[str, str]


class PairSetupFailed(ServerUnavailableError):
    """A pair could not be set up (503 ``pd_transfer_setup_failed``); ``role`` / ``node_id``
    name the node that refused, did not answer or left, so the request can try another one."""

    def __init__(self, message: str, role: str, node_id: str):
        super().__init__(message, SETUP_FAILED_CODE)
        self.role = role
        self.node_id = node_id

    def again(self) -> "PairSetupFailed":
        """A fresh copy for another waiter (one exception object is raised in one place only)."""
        return PairSetupFailed(str(self), self.role, self.node_id)


@dataclass(frozen=True)
class TransferPair:
    """A prefill and a decode node whose KV transfer groups were set up for ``epoch``."""

    prefill: NodeInfo
    decode: NodeInfo
    epoch: int

    def node(self, role: str) -> NodeInfo:
        """The pair's node of ``role``."""
        return self.prefill if role == PREFILL else self.decode

    @property
    def key(self) -> PairKey:
        """``(prefill node id, decode node id)``."""
        return self.prefill.node_id, self.decode.node_id


class PairSetup:
    """The set-up pairs keyed by (P id, D id); :meth:`pair_for` sets a pair up on first use."""

    def __init__(self, registry: NodeRegistry, nodes: NodeStreams, setup_timeout_s: float,
                 teardown_timeout_s: float = TEARDOWN_TIMEOUT_S) -> None:
        self.registry = registry
        self.nodes = nodes
        self.setup_timeout_s = setup_timeout_s
        self.teardown_timeout_s = teardown_timeout_s
        self.epoch = 0  # the last epoch handed out (failed setups use theirs up too)
        self._pairs: Dict[PairKey, TransferPair] = {}
        self._locks: Dict[PairKey, asyncio.Lock] = {}
        # Per pair: (monotonic time, error) of its last failed setup.
        self._last_failure: Dict[PairKey, Tuple[float, PairSetupFailed]] = {}
        self._teardowns: Set[asyncio.Task] = set()
        registry.add_drop_listener(self._on_drop)

    # --- reading --------------------------------------------------------------------------
    @property
    def pairs(self) -> List[TransferPair]:
        """The pairs set up now, by epoch."""
        return sorted(self._pairs.values(), key=lambda pair: pair.epoch)

    def get(self, prefill_id: str, decode_id: str) -> Optional[TransferPair]:
        """The set-up pair of these nodes, or None."""
        return self._pairs.get((prefill_id, decode_id))

    def epochs_of(self, node_id: str) -> List[int]:
        """Epochs of the set-up pairs ``node_id`` is in."""
        return [pair.epoch for pair in self.pairs if node_id in pair.key]

    def _usable(self, pair: Optional[TransferPair]) -> bool:
        return (
            pair is not None
            and self.registry.get(pair.prefill.node_id) == pair.prefill
            and self.registry.get(pair.decode.node_id) == pair.decode
        )

    # --- setting up -----------------------------------------------------------------------
    async def pair_for(self, prefill: NodeInfo, decode: NodeInfo) -> TransferPair:
        """The set-up pair of ``prefill`` and ``decode``; sets it up when there is none.

        Raises :class:`PairSetupFailed` (503 ``pd_transfer_setup_failed``) when a node refused or
        did not answer the setup, or left during it.
        """
        key = (prefill.node_id, decode.node_id)
        pair = self._pairs.get(key)
        if self._usable(pair) and pair is not None and pair.prefill == prefill and pair.decode == decode:
            return pair
        lock = self._locks.get(key)
        if lock is None:
            lock = self._locks[key] = asyncio.Lock()
        asked = time.monotonic()
        async with lock:
            pair = self._pairs.get(key)
            if self._usable(pair) and pair is not None and pair.prefill == prefill and pair.decode == decode:
                return pair
            failed = self._last_failure.get(key)
            if failed is not None and failed[0] >= asked:
                # A setup of this pair failed while this request waited for the lock: share its
                # answer rather than queueing one more full setup timeout behind every waiter.
                raise failed[1].again()
            stale = self._pairs.pop(key, None)
            if stale is not None:
                self._teardown(stale.epoch, (stale.prefill, stale.decode), "it is set up again")
            try:
                return await self._set_up(prefill, decode)
            except PairSetupFailed as exc:
                self._last_failure[key] = (time.monotonic(), exc)
                raise

    async def _set_up(self, prefill: NodeInfo, decode: NodeInfo) -> TransferPair:
        self.epoch += 1
        epoch = self.epoch
        logger.info("PD pair setup epoch %d: prefill %s, decode %s (transfer at %s)", epoch,
                    prefill.describe(), decode.describe(), prefill.kv_transfer_address)
        done: List[NodeInfo] = []
        try:
            for node, peer in ((prefill, decode), (decode, prefill)):
                body = {"epoch": epoch, "peer_node_id": peer.node_id,
                        "prefill_transfer_address": prefill.kv_transfer_address}
                try:
                    answer = await self.nodes.post_json(node, TRANSFER_SETUP_PATH, body, self.setup_timeout_s)
                except NodeCallError as exc:
                    message = f"could not set up the KV transfer of epoch {epoch} on {node.describe()}: {exc}"
                    logger.error("PD %s", message)
                    raise PairSetupFailed(f"The PD cluster is not ready: {message}", node.role, node.node_id) from None
                if answer.get("epoch") != epoch:
                    message = f"{node.describe()} answered the transfer setup of epoch {epoch} with {answer!r}"
                    logger.error("PD %s", message)
                    raise PairSetupFailed(f"The PD cluster is not ready: {message}", node.role, node.node_id)
                done.append(node)
            for node in (prefill, decode):
                if self.registry.get(node.node_id) != node:
                    # It left while it was being set up; the request places again.
                    raise PairSetupFailed(f"The PD cluster is not ready: {node.describe()} left during the transfer "
                                          f"setup of epoch {epoch}", node.role, node.node_id)
        except BaseException:
            # The nodes already set up hold a group no pair will use.
            self._teardown(epoch, done, "its setup failed")
            raise
        pair = TransferPair(prefill, decode, epoch)
        self._pairs[pair.key] = pair
        self._last_failure.pop(pair.key, None)
        logger.info("PD pair epoch %d set up", epoch)
        return pair

    # --- dropping -------------------------------------------------------------------------
    def invalidate(self, epoch: int, reason: str) -> None:
        """Drop the pair of ``epoch`` (a node reported its transfer broken) and tear it down on both."""
        for key, pair in list(self._pairs.items()):
            if pair.epoch == epoch:
                del self._pairs[key]
                logger.warning("PD pair epoch %d will be set up again: %s", epoch, reason)
                self._teardown(epoch, (pair.prefill, pair.decode), reason)

    def _on_drop(self, info: NodeInfo, reason: str) -> None:
        for key in [key for key in self._pairs if info.node_id in key]:
            pair = self._pairs.pop(key, None)
            if pair is not None:
                survivor = pair.decode if pair.prefill.node_id == info.node_id else pair.prefill
                logger.warning("PD pair epoch %d ended: %s left (%s)", pair.epoch, info.describe(), reason)
                if self.registry.get(survivor.node_id) == survivor:
                    self._teardown(pair.epoch, (survivor,), f"its peer {info.describe()} left")
                self._locks.pop(key, None)
                self._last_failure.pop(key, None)

    def _teardown(self, epoch: int, nodes: Iterable[NodeInfo], why: str) -> None:
        try:
            loop = asyncio.get_running_loop()
        except RuntimeError:
            logger.warning("PD pair epoch %d not torn down (%s): no event loop", epoch, why)
            return
        for node in nodes:
            task = loop.create_task(self._post_teardown(node, epoch, why), name=f"pd-teardown-{epoch}")
            self._teardowns.add(task)
            task.add_done_callback(self._teardowns.discard)

    async def _post_teardown(self, node: NodeInfo, epoch: int, why: str) -> None:
        try:
            await self.nodes.post_json(node, TRANSFER_TEARDOWN_PATH, {"epoch": epoch}, self.teardown_timeout_s)
            logger.info("PD pair epoch %d torn down on %s (%s)", epoch, node.describe(), why)
        except NodeCallError as exc:
            logger.warning("PD pair epoch %d: teardown on %s failed (%s): %s", epoch, node.describe(), why, exc)
        except Exception:  # noqa: BLE001 - best effort: a teardown must never take the master down
            logger.exception("PD pair epoch %d: teardown on %s failed (%s)", epoch, node.describe(), why)

    async def aclose(self) -> None:
        """Wait for the teardowns still running (each bounded by ``teardown_timeout_s``)."""
        if self._teardowns:
            await asyncio.wait(set(self._teardowns))
