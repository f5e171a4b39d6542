"""A PD node rank's backend settings: its :class:`~.pd_rank_transfer.PdRankTransfer` and decode-node limits.

Kept apart from the transfer itself: this is the one place that turns a rank's start-up config
(:class:`~.rank_config.ModelRankConfig`) into real transfer handles over the rank's KV cache.
"""

from __future__ import annotations

from typing import Any, Dict, Optional

from lightllm.server.model_rank.pd_rank_transfer import PD_ROLES, Agree, Notify, PdRankTransfer
from lightllm.server.model_rank.rank_config import ModelRankConfig
from lightllm.server.pd.kv_transfer import KVTransferHandle, TransferStoreHost
from lightllm.server.run_mode import RunMode


def pd_backend_settings(
    config: ModelRankConfig, kv_cache: Any, agree: Optional[Agree] = None, notify: Optional[Notify] = None
) -> Dict[str, Any]:
    """The PD part of a rank's backend settings (``build_rank_backend``'s ``mode_settings``); {} outside a PD node.

    A PD node's backend carries a :class:`PdRankTransfer` over ``kv_cache``, which is made
    shareable here (the transfer process reads and writes it); a decode node's backend also ends
    a segment under KV pressure instead of pausing it, and after ``--pd_max_segment_tokens``.
    ``agree`` and ``notify`` as in :class:`PdRankTransfer`.
    """
    role = config.run_mode
    if role not in PD_ROLES:
        return {}
    settings = config.pd
    kv_cache.share_buffers()

    def make_handle(side: str, host: str, port: int, group_name: str,
                    store_host: Optional[TransferStoreHost]) -> KVTransferHandle:
        return KVTransferHandle(
            side, kv_cache, host, port, page_size=settings.page_size, timeout_s=settings.transfer_timeout_s,
            # Every reservation passes its own lease (PdRankTransfer.reserve); this is only the fallback.
            connect_timeout_s=settings.connect_timeout_s, receive_wait_s=settings.lease_for(0.0),
            group_name=group_name, store_host=store_host,
        )

    mode_settings: Dict[str, Any] = {
        "transfer": PdRankTransfer(role, config.rank, settings, make_handle, agree=agree, notify=notify),
    }
    if role == RunMode.DECODE:
        mode_settings.update(end_segment_on_kv_pressure=True, max_segment_tokens=settings.max_segment_tokens)
    return mode_settings
