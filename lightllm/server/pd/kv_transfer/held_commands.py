"""Requests a handle keeps back until its transfer process has joined its group.

A transfer process needs seconds before it reads anything (a spawned interpreter imports torch,
then joins the group, which waits for the peer), and a request's transfer cannot start before
the group is joined anyway.  A command written to the pipe in that time would sit there out of
the owner's reach: a cancellation could not overtake it, and a request aborted meanwhile (its
master gone, or the request placed elsewhere) kept its reserved KV until the process got round
to it.  So the handle keeps each :class:`SendKV` / :class:`ReceiveKV` here until the process
reports :class:`ChannelReady`; meanwhile a cancellation takes it back at once, with nothing in
the process that could still touch the request's KV.

A receive's lease starts when the process takes it, as it always did: a reservation cannot get
its KV before its pair is joined, and a new pair's first requests must not run out of lease
while the pair joins (seconds; on GPUs more).  A join that never completes is bounded by the
connect timeout, after which the handle fails everything it holds.
"""

from __future__ import annotations

from typing import Dict, List, Union

from lightllm.server.pd.kv_transfer.messages import ReceiveKV, SendKV

Command = Union[SendKV, ReceiveKV]


class HeldCommands:
    """Commands held by the owner, in the order they were submitted."""

    def __init__(self) -> None:
        self._held: Dict[int, Command] = {}  # request id -> command (insertion order kept)

    def __contains__(self, request_id: int) -> bool:
        return request_id in self._held

    def __len__(self) -> int:
        return len(self._held)

    def hold(self, command: Command) -> None:
        """Keep ``command`` until :meth:`release`."""
        self._held[command.request_id] = command

    def take_back(self, request_id: int) -> bool:
        """Drop ``request_id``'s command; False when none is held."""
        return self._held.pop(request_id, None) is not None

    def release(self) -> List[Command]:
        """Every held command, in order; none is held after."""
        released = list(self._held.values())
        self._held.clear()
        return released

    def clear(self) -> None:
        """Forget every held command (the owner fails them itself)."""
        self._held.clear()
