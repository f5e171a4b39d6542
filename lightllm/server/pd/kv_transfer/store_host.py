"""A prefill rank's one TCP store, shared by all of its transfer pairs.

A prefill rank may be paired with several decode nodes at once (one pair, and one transfer
process per side, per epoch), but it has one transfer port (``--pd_transfer_port`` + rank), which
the node holds from start-up (``pd/node/transfer_ports.py``).  So the rank process serves one
``torch.distributed.TCPStore`` on that port, started at its first transfer setup, and every
transfer process of every pair, on both sides, joins it as a client under its own key prefix:

* ``<group_name>/generation``: bumped each time the prefill side (re)starts the pair's
  transfer process, so a restarted pair never meets the keys its previous group left behind;
* ``<group_name>/gen-<g>/...``: the two-rank group's rendezvous and the transfer
  announcements (:mod:`.announce`) of generation ``g``.

The store's server runs on a thread of its own (libuv), so the rank's inference step neither
serves nor waits on it.
"""

from __future__ import annotations

import os
import socket
from datetime import timedelta
from typing import Optional

import torch.distributed as dist

from lightllm.utils.wildcard_hosts import loopback_for


def connect_host(host: str) -> str:
    """The address a local client uses to reach a server bound to ``host``."""
    return loopback_for(host)


def generation_key() -> str:
    """The key (under a pair's ``group_name`` prefix) counting the prefill side's starts."""
    return "generation"


def generation_prefix(group_name: str, generation: int) -> str:
    """The key prefix of a pair's group of ``generation``."""
    return f"{group_name}/gen-{generation}"


class TransferStoreHost:
    """One TCP store server in this process, on ``listen_socket`` or on ``host:port``.

    With ``listen_socket`` (the node's socket already listening on the rank's transfer port) the
    store serves on a duplicate of it, so the node's own socket, and with it the port, stays
    held whatever happens to the store.  Without one it binds ``host:port`` itself (``port`` 0:
    any free port; tests and the benchmark).  :attr:`connect_host` and :attr:`port` are where
    this host's own transfer processes reach it.
    """

    def __init__(
        self,
        listen_socket: Optional[socket.socket] = None,
        host: str = "127.0.0.1",
        port: int = 0,
        timeout_s: float = 60.0,
    ):
        timeout = timedelta(seconds=timeout_s)
        if listen_socket is not None:
            bound, port = listen_socket.getsockname()[:2]
            self.connect_host = connect_host(bound)
            fd = os.dup(listen_socket.fileno())  # the store closes the descriptor it is given
            try:
                store = dist.TCPStore(self.connect_host, port, None, True, timeout, wait_for_workers=False,
                                      master_listen_fd=fd)
            except BaseException:
                try:
                    os.close(fd)
                except OSError:
                    pass
                raise
        else:
            self.connect_host = connect_host(host)
            store = dist.TCPStore(self.connect_host, port, None, True, timeout, wait_for_workers=False)
            port = store.port
        self._store: Optional[dist.TCPStore] = store
        self.port: int = port

    def next_generation(self, group_name: str) -> int:
        """Count one more start of ``group_name``'s prefill side; returns its generation (1, 2, ...)."""
        if self._store is None:
            raise RuntimeError("the transfer store host is closed")
        return int(dist.PrefixStore(group_name, self._store).add(generation_key(), 1))

    @property
    def closed(self) -> bool:
        """Whether :meth:`close` was called."""
        return self._store is None

    def close(self) -> None:
        """Stop serving: every client still connected sees its connection fail."""
        self._store = None
