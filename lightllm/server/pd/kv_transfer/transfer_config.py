"""What a transfer process needs besides its cache and pipe (picklable for spawn)."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class TransferConfig:
    """A transfer process's settings, from its :class:`~.handle.KVTransferHandle`."""

    role: str  # "prefill" or "decode"
    # The prefill rank's TCP store, which both sides join as clients.
    store_addr: str
    store_port: int
    # Prefix of every key the pair puts in the store: a decode side pointed at some other
    # store (a stale address, another rank's port) never matches keys and times out instead.
    group_name: str
    # Prefill side: the generation its owner counted for this start; decode side: 0, to follow
    # whatever generation the prefill side started last.
    generation: int
    page_size: int
    timeout_s: float
    connect_timeout_s: float
    failure_probability: float
    # Decode side: how long one wait for the next announcement lasts before it is renewed.
    announce_wait_s: float = 30.0
    # The rank process that starts it: the transfer process ends as soon as that one is gone
    # (owner_watch.py); 0: no watch.
    owner_pid: int = 0
