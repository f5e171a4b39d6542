"""What a node's error line, or a line out of protocol, ends a PD request with (code, metric reason)."""

from __future__ import annotations

from lightllm.server.pd.master.pair_setup import PairSetup, TransferPair
from lightllm.server.pd.master.request_run import PdRequestFailed, RequestRun
from lightllm.server.pd.protocol.node_events import LEASE_EXPIRED, RANK_FAILURE_REASONS, TRANSFER_BROKEN, TRANSFER_FAILED
from lightllm.server.pd.protocol.stream_lines import NodeLine

# ``error_kind`` values of an error line (optional) that mean the KV transfer failed: code
# ``pd_transfer_failed``.  An expired lease is one: the KV did not arrive within the lease (the
# master's own, so past its prefill wait plus the hand-off margin, or a shorter one the decode
# node's --pd_reserve_lease_seconds set).
TRANSFER_ERROR_KINDS = frozenset({TRANSFER_FAILED, TRANSFER_BROKEN, LEASE_EXPIRED})


def node_error(run: RequestRun, pairs: PairSetup, pair: TransferPair, role: str, line: NodeLine) -> PdRequestFailed:
    """The failure an ``error`` line of ``role``'s node ends the request with; a ``transfer_broken`` one
    also invalidates the pair, so it is set up again."""
    broken = line.transfer_broken
    if broken:
        pairs.invalidate(pair.epoch, f"{pair.node(role).describe()} reported its KV transfer broken")
    transfer = broken or line.error_kind in TRANSFER_ERROR_KINDS
    message = line.message or "no message"
    rank_failure = line.error_kind
    if rank_failure in RANK_FAILURE_REASONS:
        # The node's rank ended the request (a failure, or its grammar could not go on): the client
        # gets a normal server's answer.
        return PdRequestFailed(f"request {run.request_id}: {pair.node(role).describe()}: {message}",
                               rank_failure, rank_failure)
    return PdRequestFailed(
        f"request {run.request_id}: {pair.node(role).describe()} failed: {message}",
        "pd_transfer_failed" if transfer else "pd_node_failed",
        "transfer_failed" if transfer else "node_error",
        transfer_broken=broken,
    )


def protocol_error(run: RequestRun, pair: TransferPair, role: str, expected: str, line: NodeLine) -> PdRequestFailed:
    """The failure a line that is not what the protocol allows at that point ends the request with."""
    return PdRequestFailed(
        f"request {run.request_id}: {pair.node(role).describe()} sent {line.fields!r} where {expected} was expected",
        "pd_node_failed", "protocol",
    )
