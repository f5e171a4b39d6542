"""KV transfer between a PD prefill node's rank and a decode node's rank.

One transfer process per TP rank on each side (:mod:`worker`), driven by its rank process
through a :class:`KVTransferHandle` (:mod:`handle`) with small pipe messages (:mod:`messages`);
the wire protocol (:mod:`protocol`) sends a header (:mod:`header`), then pages of KV with a
checksum (:mod:`checksum`), every wait bounded (:mod:`bounded_wait`).
"""

from lightllm.server.pd.kv_transfer.handle import KVTransferHandle
from lightllm.server.pd.kv_transfer.header import TransferHeader
from lightllm.server.pd.kv_transfer.messages import (
    ChannelBroken,
    ChannelReady,
    ReceiveKV,
    SendKV,
    Shutdown,
    TransferResult,
)

__all__ = [
    "ChannelBroken",
    "ChannelReady",
    "KVTransferHandle",
    "ReceiveKV",
    "SendKV",
    "Shutdown",
    "TransferHeader",
    "TransferResult",
]
