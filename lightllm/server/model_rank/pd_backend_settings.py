"""A PD node rank's backend settings: its KV transfer (:mod:`.pd_transfer`) and decode-node limits.

Kept apart from the transfer itself: this is the one place that turns a rank's start-up config
(:class:`~.rank_config.ModelRankConfig`) into real transfer handles over the rank's KV cache,
and the one place that picks the transfer's side from the node's role.
"""

from __future__ import annotations

from typing import Any, Dict, Optional

from lightllm.common.kv_cache_mem_manager.mem_manager import KVCacheMemoryManager
from lightllm.server.model_rank.pd_transfer.base import Agree, Notify
from lightllm.server.model_rank.pd_transfer.decode import DecodeRankTransfer
from lightllm.server.model_rank.pd_transfer.prefill import PrefillRankTransfer
from lightllm.server.model_rank.rank_config import ModelRankConfig
from lightllm.server.pd.kv_transfer import KVTransferHandle, TransferStoreHost
from lightllm.server.run_mode import PD_NODE_MODES, RunMode


def pd_backend_settings(
    config: ModelRankConfig, kv_cache: KVCacheMemoryManager, agree: Optional[Agree] = None,
    notify: Optional[Notify] = None,
) -> Dict[str, Any]:
    """The PD part of a rank's backend settings (``build_rank_backend``'s ``mode_settings``); {} outside a PD node.

    A PD node's backend carries a :class:`PrefillRankTransfer` or :class:`DecodeRankTransfer`
    (by the node's role) over ``kv_cache``, which is made shareable here (the transfer process
    reads and writes it); a decode node's backend also ends a segment under KV pressure instead
    of pausing it, and after ``--pd_max_segment_tokens``.  ``agree`` and ``notify`` as in
    :class:`~.pd_transfer.base.PdRankTransfer`.
    """
    role = config.run_mode
    if role not in PD_NODE_MODES:
        return {}
    settings = config.pd
    kv_cache.share_buffers()

    def make_handle(side: str, host: str, port: int, group_name: str,
                    store_host: Optional[TransferStoreHost]) -> KVTransferHandle:
        return KVTransferHandle(
            side, kv_cache, host, port, page_size=settings.page_size, timeout_s=settings.transfer_timeout_s,
            # Every reservation passes its own lease (DecodeRankTransfer.reserve); this is only the fallback.
            connect_timeout_s=settings.connect_timeout_s, receive_wait_s=settings.lease_for(0.0),
            group_name=group_name, store_host=store_host, failure_probability=settings.transfer_failure_probability,
        )

    if role == RunMode.PREFILL:
        return {"transfer": PrefillRankTransfer(config.rank, settings, make_handle, agree=agree, notify=notify)}
    return {
        "transfer": DecodeRankTransfer(config.rank, settings, make_handle, agree=agree, notify=notify),
        "end_segment_on_kv_pressure": True,
        "max_segment_tokens": settings.max_segment_tokens,
    }
