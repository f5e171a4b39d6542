"""How long the PD master waits for each node answer of a segment, and the lease that follows from it."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class PhaseDeadlines:
    """Seconds the master waits for each node answer (the ``--pd_*_timeout_seconds`` flags).

    ``busy_retry_s``: how long busy answers are retried (``LIGHTLLM_PD_NODE_BUSY_RETRY_TIMEOUT_SECONDS``,
    read once when the master starts; 0: no retry).  ``handoff_s``: how long a prefill node's
    stream may stay open after the decode node confirmed the KV, for its ``handed_off`` line
    (``--pd_transfer_timeout_seconds``: the prefill side's own bound on the acknowledgement).
    """

    prefill_s: float
    decode_token_s: float
    busy_retry_s: float = 0.0
    handoff_s: float = 30.0

    @property
    def reserve_lease_s(self) -> float:
        """The lease the master asks a decode node to hold a segment's reservation for.

        The reservation is made before the prefill node is asked, so its lease must cover the
        whole prefill wait (a request queued on a busy prefill node is not lost while the master
        still waits for it: the master's ``pd_timeout`` fires first) plus the hand-off margin
        for the KV to start arriving after the first token.  It only fires first when the
        master is gone or broken, or the KV does not start moving within the margin.
        """
        return self.prefill_s + self.handoff_s
