"""The PD master's current prefill/decode pair and the setup of its KV transfer groups.

KV moves from P's TP rank r to D's TP rank r over a two-rank group that P hosts at its
``kv_transfer_address`` port + r.  The master owns that pairing and an integer ``epoch``: before
a request is dispatched the current pair ``(P, D, epoch)`` must be set up, which is (re)done,
under one lock, by ``POST P /pd/node/transfer_setup`` THEN ``POST D /pd/node/transfer_setup``
with a new epoch.  A pair is set up again when P or D left the cluster (or registered again,
i.e. restarted), and when a node reported its transfer broken (:meth:`PairSetup.invalidate`).

The pair sticks while both nodes stay alive: with standby nodes registered, a new pair is only
picked (the least loaded node of each role) when the current one breaks, so in-flight transfers
are never torn down by re-pairing.
"""

from __future__ import annotations

import asyncio
import logging
import time
from dataclasses import dataclass
from typing import Optional, Tuple

from lightllm.server.pd.protocol.node_info import DECODE, PREFILL, NodeInfo
from lightllm.server.pd.master.node_registry import NodeRegistry
from lightllm.server.pd.master.node_selector import NodeSelector
from lightllm.server.pd.master.node_streams import TRANSFER_SETUP_PATH, NodeCallError, NodeStreams
from lightllm.server.manager_errors import ServerUnavailableError

logger = logging.getLogger(__name__)

SETUP_FAILED_CODE = "pd_transfer_setup_failed"


@dataclass(frozen=True)
class TransferPair:
    """A prefill and a decode node whose KV transfer groups were set up for ``epoch``."""

    prefill: NodeInfo
    decode: NodeInfo
    epoch: int

    def node(self, role: str) -> NodeInfo:
        """The pair's node of ``role``."""
        return self.prefill if role == PREFILL else self.decode


class PairSetup:
    """Keeps one set-up P/D pair; :meth:`current` returns it, setting a new one up when needed."""

    def __init__(self, registry: NodeRegistry, selector: NodeSelector, nodes: NodeStreams, setup_timeout_s: float):
        self.registry = registry
        self.selector = selector
        self.nodes = nodes
        self.setup_timeout_s = setup_timeout_s
        self.epoch = 0
        self._pair: Optional[TransferPair] = None
        self._lock: Optional[asyncio.Lock] = None
        # (monotonic time, error) of the last failed setup.
        self._last_failure: Optional[Tuple[float, ServerUnavailableError]] = None
        registry.add_drop_listener(self._on_drop)

    @property
    def pair(self) -> Optional[TransferPair]:
        """The pair set up now, or None."""
        return self._pair

    def _usable(self, pair: Optional[TransferPair]) -> bool:
        return (
            pair is not None
            and self.registry.get(pair.prefill.node_id) == pair.prefill
            and self.registry.get(pair.decode.node_id) == pair.decode
        )

    async def current(self) -> TransferPair:
        """The set-up pair; picks and sets up a new one when there is none.

        Raises ``ServerUnavailableError``: ``pd_not_ready`` when a role has no live node,
        ``pd_transfer_setup_failed`` when a node refused or did not answer the setup.
        """
        if self._usable(self._pair):
            return self._pair  # type: ignore[return-value]
        if self._lock is None:
            self._lock = asyncio.Lock()
        asked = time.monotonic()
        async with self._lock:
            if self._usable(self._pair):
                return self._pair  # type: ignore[return-value]
            failed = self._last_failure
            if failed is not None and failed[0] >= asked:
                # A setup failed while this request waited for the lock: share its answer rather
                # than queueing one more full setup timeout behind every waiting request.
                raise ServerUnavailableError(str(failed[1]), failed[1].code)
            self._pair = None
            try:
                return await self._set_up()
            except ServerUnavailableError as exc:
                self._last_failure = (time.monotonic(), exc)
                raise

    async def _set_up(self) -> TransferPair:
        prefill = self.selector.pick(PREFILL)
        decode = self.selector.pick(DECODE)
        self.epoch += 1
        epoch = self.epoch
        logger.info("PD pair setup epoch %d: prefill %s, decode %s (transfer at %s)", epoch,
                    prefill.describe(), decode.describe(), prefill.kv_transfer_address)
        for node, peer in ((prefill, decode), (decode, prefill)):
            body = {"epoch": epoch, "peer_node_id": peer.node_id,
                    "prefill_transfer_address": prefill.kv_transfer_address}
            try:
                answer = await self.nodes.post_json(node, TRANSFER_SETUP_PATH, body, self.setup_timeout_s)
            except NodeCallError as exc:
                message = f"could not set up the KV transfer of epoch {epoch} on {node.describe()}: {exc}"
                logger.error("PD %s", message)
                raise ServerUnavailableError(f"The PD cluster is not ready: {message}", SETUP_FAILED_CODE) from None
            if answer.get("epoch") != epoch:
                message = f"{node.describe()} answered the transfer setup of epoch {epoch} with {answer!r}"
                logger.error("PD %s", message)
                raise ServerUnavailableError(f"The PD cluster is not ready: {message}", SETUP_FAILED_CODE)
        if self.registry.get(prefill.node_id) != prefill or self.registry.get(decode.node_id) != decode:
            # A node left while it was being set up; the next request picks again.
            raise ServerUnavailableError("The PD cluster is not ready: a node left during the transfer setup",
                                         SETUP_FAILED_CODE)
        self._pair = TransferPair(prefill, decode, epoch)
        logger.info("PD pair epoch %d set up", epoch)
        return self._pair

    def invalidate(self, epoch: int, reason: str) -> None:
        """Set the pair up again before the next request if it is still the one of ``epoch``."""
        pair = self._pair
        if pair is not None and pair.epoch == epoch:
            self._pair = None
            logger.warning("PD pair epoch %d will be set up again: %s", epoch, reason)

    def _on_drop(self, info: NodeInfo, reason: str) -> None:
        pair = self._pair
        if pair is not None and info.node_id in (pair.prefill.node_id, pair.decode.node_id):
            self._pair = None
            logger.warning("PD pair epoch %d ended: %s left (%s)", pair.epoch, info.describe(), reason)
