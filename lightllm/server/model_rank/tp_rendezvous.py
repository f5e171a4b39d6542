"""The store the tensor-parallel ranks meet through, listening on ``--nccl_host`` alone.

torch's ``tcp://`` rendezvous starts a ``TCPStore`` whose server binds the port on every
interface, whatever host the URL names: with the default ``--nccl_host 127.0.0.1`` the store
every rank waits on (unauthenticated: any client can write keys into it) was reachable from the
network.  Rank 0 therefore binds the listening socket itself, on the resolved ``--nccl_host``
address, and hands it to the store (``master_listen_fd``); the other ranks connect as before.
"""

from __future__ import annotations

import socket
from datetime import timedelta

import torch.distributed as dist


def open_rendezvous_store(host: str, port: int, rank: int, world_size: int, timeout: timedelta) -> dist.Store:
    """The TCP store of ``world_size`` ranks at ``host:port``: served by rank 0, joined by the rest.

    ``host`` may carry the URL brackets of an IPv6 address (``[::1]``).  Rank 0's socket listens
    only on the address ``host`` resolves to; its descriptor is given to the store, which keeps it
    for the life of the process.
    """
    bare = host[1:-1] if host.startswith("[") and host.endswith("]") else host
    if rank != 0:
        return dist.TCPStore(bare, port, world_size, False, timeout)
    family, kind, proto, _, address = socket.getaddrinfo(bare, port, type=socket.SOCK_STREAM)[0]
    listener = socket.socket(family, kind, proto)
    try:
        # As torch's own store binds: a port left in TIME_WAIT by an earlier server is usable.
        listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        listener.bind(address)
        listener.listen(max(world_size, 64))
    except OSError:
        listener.close()
        raise
    # detach(): the store owns the descriptor now; the Python object must not close it.
    return dist.TCPStore(bare, port, world_size, True, timeout, wait_for_workers=False,
                         master_listen_fd=listener.detach())
