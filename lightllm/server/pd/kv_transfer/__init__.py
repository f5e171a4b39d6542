"""KV transfer between a PD prefill node's rank and a decode node's rank.

One transfer process per TP rank and pair on each side (:mod:`worker`: its owner's commands on
one thread, :mod:`decode_serving` / :mod:`prefill_serving`, the group joined (:mod:`group_join`)
and the KV moved on another; it ends with its owner, :mod:`owner_watch`), driven by its rank
process through a :class:`KVTransferHandle` (:mod:`handle`) with small pipe messages
(:mod:`messages`) that never block the rank (:mod:`held_commands`, :mod:`pipe_writer`). A
prefill rank serves one TCP store (:mod:`store_host`) that every pair's transfer processes join
under their own prefix; the prefill side announces each transfer's header there
(:mod:`announce`, :mod:`header`), and only then does the decode side receive the pages of KV
with a checksum (:mod:`protocol`, :mod:`checksum`), every wait bounded (:mod:`bounded_wait`).
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
