"""KV transfer between a PD prefill node's rank and a decode node's rank.

One transfer process per TP rank and pair on each side (:mod:`worker`), driven by its rank
process through a :class:`KVTransferHandle` (:mod:`handle`) with small pipe messages
(:mod:`messages`).  A prefill rank serves one TCP store (:mod:`store_host`) that every pair's
transfer processes join under their own prefix; the prefill side announces each transfer's
header there (:mod:`announce`, :mod:`header`), and only then does the decode side receive the
pages of KV with a checksum (:mod:`protocol`, :mod:`checksum`), every wait bounded
(:mod:`bounded_wait`).
"""

from lightllm.server.pd.kv_transfer.handle import KVTransferHandle
from lightllm.server.pd.kv_transfer.header import TransferHeader
from lightllm.server.pd.kv_transfer.messages import (
    ChannelBroken,
    ChannelReady,
    QueryStats,
    ReceiveKV,
    SendKV,
    Shutdown,
    TransferResult,
    TransferStats,
)
from lightllm.server.pd.kv_transfer.store_host import TransferStoreHost

__all__ = [
    "ChannelBroken",
    "ChannelReady",
    "KVTransferHandle",
    "QueryStats",
    "ReceiveKV",
    "SendKV",
    "Shutdown",
    "TransferHeader",
    "TransferResult",
    "TransferStats",
    "TransferStoreHost",
]
