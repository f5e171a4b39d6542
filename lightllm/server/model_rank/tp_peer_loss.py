"""Telling a rank's own failure from the failure of a collective whose peer rank is gone.

When one TP rank dies (killed, out of memory), every other rank's next collective fails at once
with the transport's error ("Connection closed by peer", "Connection reset by peer").  That
failure is a consequence: the launcher's supervisor names the rank that died.  Logged as a crash
with its traceback at ERROR, it came first and loudest and pointed at the healthy rank.
"""

from __future__ import annotations

import traceback

# What gloo's TCP transport and NCCL say when the other side of a collective went away.
_PEER_GONE_PHRASES = (
    "connection closed by peer",
    "connection reset by peer",
    "broken pipe",
    "socket closed",
    "communicator was aborted",
    "remote process exited",
)


def lost_tp_peer(exc: BaseException) -> bool:
    """Whether ``exc`` is a torch.distributed collective that failed because a peer rank went away."""
    message = str(exc).lower()
    if not any(phrase in message for phrase in _PEER_GONE_PHRASES):
        return False
    frames = traceback.extract_tb(exc.__traceback__)
    return any("torch/distributed" in frame.filename.replace("\\", "/") for frame in frames)
