"""Which server roles read each flag, declared once where the flag is added.

Every flag of the server's parser is added through :func:`add_flag` with the run modes that read
it (``normal``, ``prefill``, ``decode``, ``pd_master``).  The role checks derive from that one
declaration (:mod:`~lightllm.server.launch.args_check` refuses a flag on a normal server or a PD
node that does not read it, :mod:`~lightllm.server.launch.pd_master` on the master), and so does
the "read by" column of the generated docs/*/server_args.md: a new flag is refused wherever it
would do nothing without a list to extend by hand.
"""

from __future__ import annotations

import argparse
from dataclasses import dataclass
from typing import Dict, FrozenSet, Iterable, Optional, Tuple

from lightllm.server.run_mode import RUN_MODES, RunMode

# The attribute of an argparse action that holds its readers.
_READERS_ATTR = "readers"


@dataclass(frozen=True)
class FlagReaders:
    """The run modes that read a flag, and why the others refuse it.

    ``reason`` tells apart flags read by the same roles that a role refuses in different words
    (a decode node has no prefill queue to order, and no prefill step to shape); ``None``: the
    refusal names the roles that read the flag.
    """

    roles: FrozenSet[str]
    reason: Optional[str] = None

    def __init__(self, roles: Iterable[str], reason: Optional[str] = None) -> None:
        roles = frozenset(RunMode(role).value for role in roles)  # a misspelt mode fails at import
        if not roles:
            raise ValueError("a flag is read by at least one run mode")
        object.__setattr__(self, "roles", roles)
        object.__setattr__(self, "reason", reason)

    def __contains__(self, role: object) -> bool:
        return role in self.roles

    def ordered(self) -> Tuple[str, ...]:
        """The roles in ``--run_mode``'s order of choices."""
        return tuple(mode for mode in RUN_MODES if mode in self.roles)


_NORMAL, _PREFILL, _DECODE, _MASTER = RunMode.NORMAL, RunMode.PREFILL, RunMode.DECODE, RunMode.PD_MASTER

EVERY_ROLE = FlagReaders(RUN_MODES)
# The processes that run the model; the master loads no weights.
MODEL_ROLES = FlagReaders((_NORMAL, _PREFILL, _DECODE))
# The public API's request handling: a PD cluster's master serves it, a node's own endpoints take
# requests the master already built.
PUBLIC_API = FlagReaders((_NORMAL, _MASTER), reason="public_api")
# The prefill queue's order and its bound: a decode node never prefills a prompt (it receives the KV).
PREFILL_QUEUE = FlagReaders((_NORMAL, _PREFILL), reason="prefill_queue")
# The prefill step's budget: a decode node's forwards are decode steps only.
PREFILL_STEP = FlagReaders((_NORMAL, _PREFILL), reason="prefill_step")
# The router's admission limits and cadence: a decode node's router admits every arrival at once
# (its rank reserves KV for it or answers busy at once).
ADMISSION = FlagReaders((_NORMAL, _PREFILL), reason="admission")
# Mixed prefill/decode batches: only a normal server both prefills and decodes.
MIXED_BATCHES = FlagReaders((_NORMAL,), reason="mixed_batches")
PD_CLUSTER = FlagReaders((_PREFILL, _DECODE, _MASTER))
PD_NODES = FlagReaders((_PREFILL, _DECODE))
PREFILL_NODES = FlagReaders((_PREFILL,))
DECODE_NODES = FlagReaders((_DECODE,))
PD_MASTER_ONLY = FlagReaders((_MASTER,))
# The KV wire's page size is the prefill side's: each transfer's header carries it and a decode
# node follows the header.
WIRE_PAGE_SIZE = FlagReaders((_PREFILL,), reason="wire_page_size")


def add_flag(group: argparse._ActionsContainer, *names: str, roles: FlagReaders, **kwargs: object) -> argparse.Action:
    """``group.add_argument(*names, **kwargs)``, recording on the flag the roles that read it."""
    action = group.add_argument(*names, **kwargs)
    setattr(action, _READERS_ATTR, roles)
    return action


def readers_of(action: argparse.Action) -> FlagReaders:
    """The roles that read the flag ``action`` (``TypeError`` for one added without :func:`add_flag`)."""
    readers = getattr(action, _READERS_ATTR, None)
    if readers is None:
        raise TypeError(f"{'/'.join(action.option_strings) or action.dest} was added without the roles that read it "
                        "(lightllm.server.launch.flag_roles.add_flag)")
    return readers


def flag_readers(parser: argparse.ArgumentParser) -> Dict[str, FlagReaders]:
    """``dest -> readers`` of every flag of ``parser`` but argparse's own ``--help``."""
    return {action.dest: readers_of(action) for action in parser._actions  # argparse lists flags only here
            if action.option_strings and not isinstance(action, argparse._HelpAction)}
