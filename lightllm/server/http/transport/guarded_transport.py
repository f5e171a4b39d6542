"""The transport uvicorn sees under the guarded protocol: closes and writes to a lost connection go through it.

``close`` asks the protocol (:class:`~lightllm.server.http.transport.protocol.GuardedH11Protocol`), which may
linger first; a write to a transport that is already closing (a send failed: the client reset the
connection) is dropped and tells the protocol its client is lost, instead of reaching asyncio's
transport, which warns ``socket.send() raised exception.`` for such writes (see the protocol
module's docstring).
"""

from __future__ import annotations

import asyncio
from typing import Any, Protocol


class TransportOwner(Protocol):
    """What :class:`GuardedTransport` needs of the protocol that owns it."""

    lingering: bool

    def close_transport(self, force: bool = False) -> None:
        """Close the connection, lingering first where the client may still be sending."""

    def client_lost_on_write(self) -> None:
        """A write found the transport closing: the client is gone for this response."""


class GuardedTransport:
    """The transport uvicorn sees: ``close`` goes through the protocol, which may linger first."""

    def __init__(self, transport: asyncio.Transport, protocol: TransportOwner) -> None:
        self._transport = transport
        self._protocol = protocol

    def close(self) -> None:
        """Close through the owner, which may linger instead of closing at once."""
        self._protocol.close_transport()

    def write(self, data: Any) -> None:
        """Write ``data``; on a closing transport drop it and tell the owner its client is lost."""
        if self._transport.is_closing():
            self._protocol.client_lost_on_write()
            return
        self._transport.write(data)

    def writelines(self, chunks: Any) -> None:
        """Write ``chunks``; on a closing transport drop them and tell the owner its client is lost."""
        if self._transport.is_closing():
            self._protocol.client_lost_on_write()
            return
        self._transport.writelines(chunks)

    def is_closing(self) -> bool:
        """True while the owner lingers (the answer is sent, the socket not yet closed) or the transport closes."""
        return self._protocol.lingering or self._transport.is_closing()

    def __getattr__(self, name: str) -> Any:
        return getattr(self._transport, name)
