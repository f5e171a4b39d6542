"""Defaults of a PD node's KV transfer, named once for the parser, the ranks' settings and the transfer.

The flags' defaults (:mod:`lightllm.server.launch.pd_flags`), the rank's settings
(:class:`~lightllm.server.model_rank.rank_config.PdRankSettings`) and the transfer handle
(:class:`~lightllm.server.pd.kv_transfer.handle.KVTransferHandle`) read them from here: a module of
its own, importing nothing, because the launcher must not import the KV transfer (torch) and the
transfer must not import the model rank (pd stands below model_rank).
"""

from __future__ import annotations

# The defaults of --pd_kv_page_size and --pd_transfer_timeout_seconds.
DEFAULT_PD_KV_PAGE_SIZE = 256
DEFAULT_PD_TRANSFER_TIMEOUT_S = 30.0
# The least time a transfer group's join is given: both transfer processes must start (spawn,
# import torch) and meet, which takes longer than one wait of a running transfer. A longer
# --pd_transfer_timeout_seconds raises it (connect_timeout_for).
CONNECT_TIMEOUT_FLOOR_S = 60.0


def connect_timeout_for(transfer_timeout_s: float) -> float:
    """The join bound of a transfer group whose waits are bounded by ``transfer_timeout_s``."""
    return max(CONNECT_TIMEOUT_FLOOR_S, transfer_timeout_s)
