"""The send deadline of a connection (``--http_send_timeout``): closed when its client reads nothing.

Generation does not wait for a slow reader, so a client that stopped reading a stream had every
later token buffered for it until the generation ended (32 MiB for one ``n: 16`` stream with
alternatives).  While uvicorn's writes to a connection are paused (its buffer above the high-water
mark), :class:`SendDeadline` watches how many bytes the connection still has to deliver, asyncio's
buffer *and* the kernel's send queue (``SIOCOUTQ``): asyncio moves bytes into the kernel only when
the socket turns writable, which Linux reports after about half of a send queue of up to 4 MiB
drained, so a client reading 40 KB/s showed no change in asyncio's buffer for 36 s.  Any drop is
progress; ``timeout`` seconds without one close the connection, which aborts a request still
running on it.  nginx's ``send_timeout`` is the same rule, at the same 60 s default.
"""

from __future__ import annotations

import asyncio
import fcntl
import struct
import termios
from typing import Callable, Optional

# How often a paused connection's unsent bytes are looked at (a timeout shorter than four polls
# is polled four times): the close comes at most this late.
POLL_SECONDS = 1.0


def unsent_bytes(transport: asyncio.WriteTransport) -> int:
    """Bytes ``transport`` has accepted that its peer has not yet taken: asyncio's buffer plus the
    kernel's send queue (0 for the latter where ``SIOCOUTQ`` cannot be read)."""
    unsent = transport.get_write_buffer_size()
    sock = transport.get_extra_info("socket")
    if sock is None:
        return unsent
    try:
        queued = fcntl.ioctl(sock.fileno(), termios.TIOCOUTQ, b"\0\0\0\0")  # TIOCOUTQ is SIOCOUTQ on Linux
    except OSError:
        return unsent
    return unsent + struct.unpack("i", queued)[0]


class SendDeadline:
    """Calls ``expire`` once no byte of ``transport``'s unsent data was taken for ``timeout`` seconds
    between :meth:`start` and :meth:`stop`."""

    def __init__(self, loop: asyncio.AbstractEventLoop, transport: asyncio.WriteTransport, timeout: float,
                 expire: Callable[[], None]) -> None:
        self._loop = loop
        self._transport = transport
        self._timeout = timeout
        self._expire = expire
        self._poll_s = min(POLL_SECONDS, timeout / 4)
        self._timer: Optional[asyncio.TimerHandle] = None
        self._unsent = 0
        self._progress_at = 0.0

    @property
    def running(self) -> bool:
        """Whether the deadline is being watched (between :meth:`start` and :meth:`stop` or expiry)."""
        return self._timer is not None

    def start(self) -> None:
        """Begin watching (writes were paused); a second start while watching changes nothing."""
        if self._timer is None:
            self._unsent = unsent_bytes(self._transport)
            self._progress_at = self._loop.time()
            self._timer = self._loop.call_later(self._poll_s, self._poll)

    def stop(self) -> None:
        """Stop watching (writes resumed, or the connection is gone)."""
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None

    def _poll(self) -> None:
        now = self._loop.time()
        unsent = unsent_bytes(self._transport)
        # While writes are paused little is added (a response's last write): a drop is the client reading.
        if unsent < self._unsent:
            self._progress_at = now
        self._unsent = unsent
        if now - self._progress_at >= self._timeout:
            self._timer = None
            self._expire()
            return
        self._timer = self._loop.call_later(min(self._poll_s, self._progress_at + self._timeout - now), self._poll)
