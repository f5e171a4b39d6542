"""The KV transfer process: a child of one TP rank process, paired with the peer node's.

It joins its own two-rank torch.distributed group (rank 0 = prefill side, rank 1 = decode side;
gloo for CPU caches, NCCL for CUDA ones), never the rank's TP group, and serves :mod:`messages`
commands from its owner's pipe.  Both sides meet in the prefill rank's one TCP store
(:mod:`store_host`) as clients, under their pair's key prefix and the prefill side's current
generation (:mod:`group_join`).  Transfers are announced through that store (:mod:`announce`):
the decode side posts receives only for an announced transfer, so an idle pair holds nothing
pending on its group.

Two threads: the main one reads the owner's pipe at all times (so the owner never blocks on a
full pipe, and a lease, a cancelled receive or a cancelled send is honoured at once, whatever
the group is doing), a worker thread joins the group and moves KV (:mod:`decode_serving`,
:mod:`prefill_serving`).  On a fault of the group or the store (timeout, dead peer) it fails
everything it holds, reports :class:`ChannelBroken` and exits; the owner starts a fresh one or
drops the pair.  It also exits as soon as its owner is gone (:mod:`owner_watch`).
"""

from __future__ import annotations

import os
import time
from multiprocessing.connection import Connection

import torch

from lightllm.common.kv_cache_mem_manager.mem_manager import KVCacheMemoryManager
from lightllm.server.pd.kv_transfer.child_outbox import ChildOutbox
from lightllm.server.pd.kv_transfer.decode_serving import serve_decode
from lightllm.server.pd.kv_transfer.owner_watch import exit_with_owner
from lightllm.server.pd.kv_transfer.prefill_serving import serve_prefill
from lightllm.server.pd.kv_transfer.transfer_config import TransferConfig
from lightllm.server.run_mode import RunMode
from lightllm.utils.process_utils import ignore_group_stop_signals


def run_transfer_process(config: TransferConfig, conn: Connection, cache: KVCacheMemoryManager) -> None:
    """Entry point of the child process."""
    ignore_group_stop_signals()  # stopped by a Shutdown message, or killed, by the rank that owns it
    exit_with_owner(config.owner_pid)
    torch.set_num_threads(1)
    started = time.monotonic()
    if cache.device.type == "cuda":
        torch.cuda.set_device(cache.device)
    outbox = ChildOutbox(conn)
    if config.role == RunMode.PREFILL:
        serve_prefill(config, conn, cache, outbox, started)
    else:
        serve_decode(config, conn, cache, outbox, started)
    # Skip interpreter teardown: the worker thread may still sit in a store wait, and destroying
    # the group under a thread aborts noisily.  Every message was sent synchronously.
    os._exit(0)
