"""Waiting for the spawned children to report ready, watching every one of them at once.

Each child reports once through its pipe: ``("ready", ...)``, ``("refused", message)`` (a setting
it checks itself) or ``("error", message)``.  The launcher waits on every pipe *and* every child's
exit at once: waiting on one child at a time missed a TP rank that died while rank 0 was still
being waited for (rank 0 then blocked in the rendezvous for the dead rank, and the server sat in
"starting" for the whole ready timeout).  And when one rank dies, the others fail next (their
collective's peer is gone) and report that failure, which blames the wrong process; so an error
is held for a short grace, and a child that exited meanwhile is named first.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from multiprocessing import connection
from typing import Any, Dict, List, Set

from lightllm.server.argument_error import ArgumentError
from lightllm.utils.process_utils import describe_exit_code

# How long an error a child reports waits for news of another child's death, which then comes
# first in the message (a rank's collective fails within milliseconds of its peer's death).
PEER_DEATH_GRACE_SECONDS = 1.0


class StartupError(RuntimeError):
    """The server could not start; the message is one line for the user."""


@dataclass
class StartingChild:
    """A spawned child and the receiving end of its ready pipe."""

    name: str
    process: Any  # multiprocessing.Process (spawn context)
    conn: connection.Connection


def _died(child: StartingChild) -> bool:
    return child.process.exitcode is not None


def _exit_line(child: StartingChild) -> str:
    return f"{child.name} exited during start-up ({describe_exit_code(child.process.exitcode)})"


def _dead_peers(children: List[StartingChild], besides: StartingChild, said: Set[str]) -> List[StartingChild]:
    """Children other than ``besides`` that died without a word (a kill, the OOM killer).

    One that reported an error of its own before it exited is not a cause: it likely failed
    because of ``besides``'s failure, whose message is the one to read.  ``said`` holds the names
    of the children whose message was read here already (a second read finds only the pipe's end).
    """
    return [child for child in children
            if child is not besides and _died(child) and child.process.exitcode != 0 and not _reported(child, said)]


def _reported(child: StartingChild, said: Set[str]) -> bool:
    """Whether the exited ``child`` sent a message (read here: the start fails anyway).

    Its pipe reads as ready at its end too, so only reading tells a message from the end.
    """
    if child.name in said:
        return True
    if not child.conn.poll(0):
        return False
    try:
        child.conn.recv()
    except (EOFError, OSError):
        return False
    said.add(child.name)
    return True


def wait_for_children_ready(children: List[StartingChild], timeout_s: float,
                            grace_s: float = PEER_DEATH_GRACE_SECONDS) -> None:
    """Return once every child reported ready; raise the first failure as one line.

    Raises :class:`ArgumentError` for a child's refusal and :class:`StartupError` for a child
    that reported an error, exited before reporting, or did not report within ``timeout_s``.
    """
    deadline = time.monotonic() + timeout_s
    waiting: Dict[Any, StartingChild] = {child.conn: child for child in children}
    # Every child is watched until all are ready: one that reported ready and then died (the
    # router, say) would otherwise be noticed only at the timeout, under another child's name.
    sentinels = {child.process.sentinel: child for child in children}
    while waiting:
        remaining = deadline - time.monotonic()
        if remaining <= 0:
            names = ", ".join(child.name for child in waiting.values())
            raise StartupError(f"{names} did not report ready within {timeout_s:.0f}s")
        woken = connection.wait(list(waiting) + list(sentinels), timeout=remaining)
        # Messages first: a child that reported its error and then exited must be heard.
        for conn in [item for item in woken if item in waiting]:
            child = waiting.pop(conn)
            try:
                kind, detail = conn.recv()
            except EOFError:
                raise StartupError(_exit_line(_joined(child))) from None
            if kind == "ready":
                continue
            if kind == "refused":
                # A setting the child checks itself: the same one line and exit code as a flag
                # the launcher refuses.
                raise ArgumentError(detail)
            raise StartupError(_with_dead_peer(children, child, str(detail), grace_s))
        for sentinel in [item for item in woken if item in sentinels]:
            child = sentinels[sentinel]
            if child.conn not in waiting or not child.conn.poll(0):
                # Exited before everyone was ready: after its ready message, or without one.
                raise StartupError(_exit_line(_joined(child)))


def _joined(child: StartingChild) -> StartingChild:
    """The child with its exit code read (its sentinel fires a moment before ``exitcode`` is set)."""
    child.process.join(timeout=1.0)
    return child


def _with_dead_peer(children: List[StartingChild], failed: StartingChild, detail: str, grace_s: float) -> str:
    """``failed``'s error, after the line of a child that died (the likely cause), if one did."""
    deadline = time.monotonic() + grace_s
    said: Set[str] = set()
    while True:
        # The living are listed before the dead are counted: a peer that dies in between is
        # counted, and one that dies after is still waited for (its sentinel wakes the wait).
        others = [child.process.sentinel for child in children if child is not failed and not _died(child)]
        dead = _dead_peers(children, failed, said)
        remaining = deadline - time.monotonic()
        if dead or not others or remaining <= 0:
            break
        connection.wait(others, timeout=remaining)
    if not dead:
        return detail
    return f"{_exit_line(_joined(dead[0]))}; then {detail}"
