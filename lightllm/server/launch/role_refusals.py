"""Refuse a flag given to a normal server or a PD node that does not read it, in one line.

Which roles read each flag is declared where the flag is added
(:mod:`lightllm.server.launch.flag_roles`); this module only words the refusals, by the kind of
flag: a decode node has no prefill queue to order, a node does not serve the public API, and so
on.  The PD master refuses the flags it does not read itself
(:func:`lightllm.server.launch.pd_master.check_master_flags`), naming the node role that takes each.
"""

from __future__ import annotations

import argparse
from typing import Callable, Dict, List, Tuple

from lightllm.server.argument_error import ArgumentError
from lightllm.server.launch.arg_parser import flag_names, flags_given, server_flag_readers
from lightllm.server.launch.flag_roles import (
    ADMISSION,
    DECODE_NODES,
    MIXED_BATCHES,
    PD_MASTER_ONLY,
    PREFILL_QUEUE,
    PREFILL_STEP,
    PUBLIC_API,
    WIRE_PAGE_SIZE,
    FlagReaders,
)
from lightllm.server.run_mode import PD_NODE_MODES, PD_RUN_MODES, RunMode


def _listed(names: List[str]) -> str:
    return ", ".join("--" + name for name in names)


def _them(names: List[str]) -> str:
    return "it" if len(names) == 1 else "them"


# How a refusal names the readers of a flag.
_ROLE_NAMES = {RunMode.NORMAL.value: "normal servers", RunMode.PREFILL.value: "prefill nodes",
               RunMode.DECODE.value: "decode nodes", RunMode.PD_MASTER.value: "the PD master"}


def _read_elsewhere(names: List[str], readers: FlagReaders, run_mode: str) -> str:
    """The refusal naming the roles that read the flags (the words of every kind without its own)."""
    roles = readers.ordered()
    return (f"{_listed(names)}: read by {' and '.join(_ROLE_NAMES[role] for role in roles)} only "
            f"(--run_mode {' or '.join(roles)}), not by a {run_mode} node")


def _wire_page_size(names: List[str], readers: FlagReaders, run_mode: str) -> str:
    return _read_elsewhere(names, readers, run_mode) + ", which takes the page size from each transfer's header"


def _prefill_queue(names: List[str], readers: FlagReaders, run_mode: str) -> str:
    return (f"{_listed(names)}: a decode node never prefills a prompt (it receives the KV), so it has no prefill "
            f"queue to order; give {_them(names)} to the prefill node")


def _prefill_step(names: List[str], readers: FlagReaders, run_mode: str) -> str:
    return (f"{_listed(names)}: a decode node never prefills a prompt (it receives the KV; its forwards are decode "
            "steps of at most --running_max_req_size rows), so there is no prefill step to shape; give "
            f"{_them(names)} to the prefill node")


def _admission(names: List[str], readers: FlagReaders, run_mode: str) -> str:
    return (f"{_listed(names)}: a decode node's router admits every arrival at once (its rank reserves KV for it "
            f"or answers busy at once), so there are no admission limits or rounds to set; give {_them(names)} to "
            "the prefill node")


def _mixed_batches(names: List[str], readers: FlagReaders, run_mode: str) -> str:
    why = ("a prefill node never decodes (each request leaves it after its first token)" if run_mode == RunMode.PREFILL
           else "a decode node never prefills a prompt (it receives the KV)")
    return f"{_listed(names)}: {why}, so it runs no mixed batches; give {_them(names)} to a normal server"


def _public_api(names: List[str], readers: FlagReaders, run_mode: str) -> str:
    one = len(names) == 1
    return (f"{_listed(names)} configure{'s' if one else ''} the public API, which the PD master serves; give "
            f"{_them(names)} to the master, not to a {run_mode} node")


def _roles_phrase(readers: FlagReaders) -> str:
    names = [_ROLE_NAMES[role] for role in readers.ordered()]
    listed = names[0] if len(names) == 1 else ", ".join(names[:-1]) + " and " + names[-1]
    return f"{listed} (--run_mode {' or '.join(readers.ordered())})"


def _where_read(names: List[str]) -> str:
    """Which roles read each of ``names``: "give it to ..." for one kind, flag by flag for several."""
    readers = server_flag_readers()
    kinds: Dict[FlagReaders, List[str]] = {}
    for name in names:
        kinds.setdefault(readers[name], []).append(name)
    if len(kinds) == 1:
        return f"give {_them(names)} to {_roles_phrase(readers[names[0]])}"
    return "give " + ", ".join(f"{_listed(group)} to {_roles_phrase(kind)}" for kind, group in kinds.items())


_Refusal = Callable[[List[str], FlagReaders, str], str]
# What a PD node says about the flags it does not read, by their readers (flag_roles), in the
# order it reports them (the first kind given is refused); the kinds common to both nodes last.
_NODE_REFUSALS: Dict[str, Tuple[Tuple[Tuple[FlagReaders, ...], _Refusal], ...]] = {
    RunMode.PREFILL.value: (((DECODE_NODES,), _read_elsewhere), ((MIXED_BATCHES,), _mixed_batches)),
    RunMode.DECODE.value: (((WIRE_PAGE_SIZE,), _wire_page_size), ((PREFILL_QUEUE,), _prefill_queue),
                     ((PREFILL_STEP,), _prefill_step), ((MIXED_BATCHES,), _mixed_batches), ((ADMISSION,), _admission)),
}
_EVERY_NODE_REFUSES = (((PD_MASTER_ONLY,), _read_elsewhere), ((PUBLIC_API,), _public_api))


def _flags_not_read(args: argparse.Namespace, run_mode: str) -> List[str]:
    """The flags the command line wrote that ``run_mode`` does not read, in the parser's order."""
    readers = server_flag_readers()
    return flags_given(args, [name for name in flag_names(args) if name in readers and run_mode not in readers[name]])


def _check_node_flag_roles(args: argparse.Namespace, run_mode: str) -> None:
    """Refuse the flags a PD node of ``run_mode`` does not read, in the words of their kind."""
    refused = _flags_not_read(args, run_mode)
    if not refused:
        return
    readers = server_flag_readers()
    # Every kind given is named at once (one line, its refusals one after another), so a
    # command line is put right in one go.
    refusals: List[str] = []
    worded: List[str] = []
    for kinds, refusal in _NODE_REFUSALS[run_mode] + _EVERY_NODE_REFUSES:
        given = [name for name in refused if readers[name] in kinds]
        if given:
            refusals.append(refusal(given, readers[given[0]], run_mode))
            worded.extend(given)
    # Kinds without words of their own: the flags read by the same roles, group by group.
    rest = [name for name in refused if name not in worded]
    while rest:
        first = readers[rest[0]]
        group = [name for name in rest if readers[name].roles == first.roles]
        refusals.append(_read_elsewhere(group, first, run_mode))
        rest = [name for name in rest if name not in group]
    raise ArgumentError("; ".join(refusals))


def refuse_flags_not_read(args: argparse.Namespace) -> None:
    """Raise :class:`ArgumentError` (one line naming them) for the flags the command line gave to a
    normal server or a PD node that does not read them; a PD master's are left to its own check."""
    run_mode = args.run_mode
    if run_mode not in PD_RUN_MODES:
        # Every flag a normal server does not read configures a PD cluster.
        given = _flags_not_read(args, run_mode)
        if given:
            one = len(given) == 1
            raise ArgumentError(f"{_listed(given)} configure{'s' if one else ''} PD clusters and do{'es' if one else ''} "
                                f"nothing on --run_mode {run_mode}; {_where_read(given)} (docs/EN/pd_deployment.md)")
    elif run_mode in PD_NODE_MODES:
        _check_node_flag_roles(args, run_mode)
