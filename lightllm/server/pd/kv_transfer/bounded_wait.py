"""Waiting on a point-to-point operation with a deadline, for gloo and NCCL alike.

A transfer process must never wait unboundedly on its peer.  Gloo bounds the wait itself
(``work.wait(timeout)``; a timeout closes the connection, so the group is then unusable and
the owner replaces the process).  NCCL's ``wait`` only orders streams, so completion is polled
against the deadline instead.  Neither path aborts a communicator to unblock: on a timeout the
caller gives up on the group and the process is replaced.
"""

from __future__ import annotations

import time
from datetime import timedelta

import torch.distributed as dist


def first_line(exc: BaseException) -> str:
    """The first line of an exception's message (torch's carry a C++ trace after it)."""
    text = str(exc)
    return text.splitlines()[0] if text else type(exc).__name__


class ChannelFault(RuntimeError):
    """The two-rank group failed (timeout or dead peer); it must be replaced."""


def wait_work(work: dist.Work, timeout_s: float, what: str, polled: bool) -> None:
    """Wait for ``work`` at most ``timeout_s`` seconds; raise :class:`ChannelFault` otherwise.

    ``polled`` selects completion polling (NCCL) over gloo's own timed wait.
    """
    try:
        if not polled:
            work.wait(timedelta(seconds=timeout_s))
            return
        deadline = time.monotonic() + timeout_s
        while not work.is_completed():
            if time.monotonic() > deadline:
                raise ChannelFault(f"timed out after {timeout_s:g} s waiting for {what}")
            time.sleep(0.0005)
        work.wait()
    except ChannelFault:
        raise
    except RuntimeError as exc:
        message = first_line(exc)
        if "timeout" in message.lower() or "timed out" in message.lower():
            raise ChannelFault(f"timed out after {timeout_s:g} s waiting for {what}") from exc
        raise ChannelFault(f"peer failed while waiting for {what}: {message}") from exc
