"""What the benchmark and simulator command lines share: one-line usage errors and argument types
that check paths and numbers while the flags are parsed, before any long work starts.

:class:`OneLineErrorParser` is the project's (:mod:`lightllm.utils.one_line_errors`: ``error:
<message> (--help lists the flags)``, exit 2), exported here so a tool has one import for its parser
and its types.

A type here raises :class:`argparse.ArgumentTypeError`, so argparse prefixes the flag:
``error: argument --json: the directory of '/x/out.json' does not exist``.

Checks that need more than one flag use the helpers after ``parse_args``: :func:`given_flags`
(which flags were typed, so one the run would ignore can be refused), :func:`refuse_repeated_flags`
(a flag typed twice, whose first value argparse would drop), :func:`refuse_repeated_values` (a
value a list flag names twice), :func:`with_flag_names`
(a config object's ``ValueError`` with its field names given as the flags) and
:func:`missing_module` (a module that cannot be found, found without importing it) and
:func:`sequence_too_long` (prompt and output lengths the checkpoint's context cannot hold).
"""

from __future__ import annotations

import argparse
import importlib.machinery
import importlib.util
import ipaddress
import os
import re
import shlex
import sys
import tempfile
from pathlib import Path
from typing import Callable, Collection, List, Mapping, Optional, Sequence
from urllib.parse import urlsplit

from lightllm.utils.one_line_errors import (OneLineErrorParser, finite_float, given_flags, refuse_repeated_flags,
                                            with_flag_names)

__all__ = [
    "OneLineErrorParser", "argument_type", "checkpoint_dir", "comma_items", "finite_float", "given_flags",
    "http_url", "listen_host", "missing_module", "non_negative_float", "non_negative_int", "output_dir", "output_file",
    "output_file_in_new_dirs", "positive_float", "refuse_repeated_flags", "refuse_repeated_values",
    "sequence_too_long", "shell_words", "with_flag_names",
]


def non_negative_int(text: str) -> int:
    """An integer >= 0."""
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"must be an integer >= 0, got {text!r}") from None
    if value < 0:
        raise argparse.ArgumentTypeError(f"must be an integer >= 0, got {value}")
    return value


def non_negative_float(text: str) -> float:
    """A finite number >= 0."""
    value = finite_float(text)
    if value < 0:
        raise argparse.ArgumentTypeError(f"must be a finite number >= 0, got {text!r}")
    return value


def comma_items(text: str) -> List[str]:
    """The items of a comma list, stripped; ``ValueError`` for an empty item (``1024,,4096``: a typo
    that would otherwise drop a value silently) or an empty list."""
    items = [part.strip() for part in text.split(",")]
    if not any(items):
        raise ValueError(f"expected a comma list, got {text!r}")
    if not all(items):
        raise ValueError(f"{text!r} has an empty item between commas")
    return items


def refuse_repeated_values(values: Sequence[object], flag: str) -> None:
    """Raise ``ValueError`` (``<flag> names <value> twice; name each once``) for a value named twice.

    A value named twice would be run and printed twice, or, where the values are keys (``--slo
    ttft:500 ttft:1``), one of them would silently win.  A list, not a set, holds what was seen,
    so values need not be hashable.
    """
    seen: List[object] = []
    for value in values:
        if value in seen:
            raise ValueError(f"{flag} names {value!r} twice; name each once")
        seen.append(value)


def positive_float(text: str) -> float:
    """A finite number > 0."""
    value = finite_float(text)
    if value <= 0:
        raise argparse.ArgumentTypeError(f"must be a finite number > 0, got {text!r}")
    return value


def shell_words(text: str) -> str:
    """Flags given as one shell-quoted string (split later with ``shlex.split``); refused when unbalanced."""
    try:
        shlex.split(text)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(f"{text!r} is not a valid shell-quoted string: {exc}") from None
    return text


def argument_type(parse: Callable[[str], object]) -> Callable[[str], object]:
    """``parse`` as an argparse type: its ``ValueError`` message is kept (argparse would drop it)."""

    def convert(text: str) -> object:
        try:
            return parse(text)
        except ValueError as exc:
            raise argparse.ArgumentTypeError(str(exc)) from None

    convert.__name__ = getattr(parse, "__name__", "value")
    return convert


def _cannot_write_in(directory: Path) -> Optional[str]:
    """Why no file can be created in the existing ``directory`` (None when one can).

    Creating one is the only reliable test: permission bits say nothing for root, nor for
    /proc or a read-only mount.
    """
    try:
        with tempfile.TemporaryFile(dir=directory):
            pass
    except OSError as exc:
        return f"no file can be created in {str(directory)!r} ({exc.strerror or exc})"
    return None


def _cannot_create(directory: Path) -> Optional[str]:
    """Why the missing ``directory`` (absolute) cannot be created with its parents (None when it can)."""
    existing = directory
    while not existing.exists() and existing != existing.parent:
        existing = existing.parent
    if not existing.is_dir():
        return f"{str(existing)!r} is not a directory"
    return _cannot_write_in(existing)


def _not_a_file(text: str) -> None:
    if not text:
        raise argparse.ArgumentTypeError("must name a file, got ''")
    if Path(text).is_dir():
        raise argparse.ArgumentTypeError(f"{text!r} is a directory, not a file")


def output_file(text: str) -> str:
    """A file the tool can write: its directory exists and takes new files; not a directory itself."""
    _not_a_file(text)
    path = Path(text)
    directory = path.absolute().parent
    if not directory.is_dir():
        raise argparse.ArgumentTypeError(f"the directory of {text!r} does not exist")
    why = _cannot_write_in(directory)
    if why is None and path.exists() and not os.access(path, os.W_OK):
        why = "permission denied"
    if why is not None:
        raise argparse.ArgumentTypeError(f"{text!r} cannot be written: {why}")
    return text


def output_file_in_new_dirs(text: str) -> str:
    """A file the tool can write after creating its missing directories."""
    _not_a_file(text)
    directory = Path(text).absolute().parent
    if directory.is_dir():
        return output_file(text)
    why = _cannot_create(directory)
    if why is not None:
        raise argparse.ArgumentTypeError(f"the directory of {text!r} cannot be created: {why}")
    return text


def output_dir(text: str) -> str:
    """A directory the tool can write files in: it exists and takes files, or it can be created."""
    if not text:
        raise argparse.ArgumentTypeError("must name a directory, got ''")
    path = Path(text).absolute()
    if path.exists():
        why = _cannot_write_in(path) if path.is_dir() else "it is not a directory"
        if why is not None:
            raise argparse.ArgumentTypeError(f"{text!r} cannot be written in: {why}")
    else:
        why = _cannot_create(path)
        if why is not None:
            raise argparse.ArgumentTypeError(f"{text!r} cannot be created: {why}")
    return text


def server_url(text: str, schemes: Collection[str] = ("http", "https")) -> str:
    """``SCHEME://HOST[:PORT]`` of a running server, one of ``schemes``, with a valid port if one is given.

    Checked while parsing: ``http://127.0.0.1:99999`` (no such port) was otherwise tried and
    reported as "Connection refused", which says the server is down, not that the URL is wrong.
    A password in the URL's userinfo is masked in every refusal (they reach logs and terminals).
    """
    shown = _masked_password(text)
    # urlsplit's messages quote parts of the URL ("... integer value as 's3cr'" for
    # "http://u:s3cr?t@h:1"): they are shown only for a URL with no password in it.
    masked = shown != text
    shape = " or ".join(f"{scheme}://HOST[:PORT]" for scheme in schemes)
    try:
        parts = urlsplit(text)
    except ValueError as exc:  # "http://[::1:8000": unbalanced brackets
        why = "" if masked else f" ({exc})"
        raise argparse.ArgumentTypeError(f"{shown!r} is not a URL{why}; must be {shape}") from None
    # The scheme first: advice on the host of a URL refused anyway for its scheme misleads.
    if parts.scheme not in schemes:
        raise argparse.ArgumentTypeError(f"must be {shape}, got {shown!r}")
    if _is_unbracketed_ipv6(parts.netloc.rpartition("@")[2]):
        # Else urlsplit reads "::1:18610" as host "" and port ":1:18610", and says the port is no integer.
        # No rebuilt URL is offered: which colon starts the port is what the brackets decide.
        raise argparse.ArgumentTypeError(f"{shown!r}: put the IPv6 address in brackets (as in "
                                         f"{parts.scheme}://[::1]:8000)")
    valid = "a number in 1..65535"
    try:
        port = parts.port  # raises ValueError for a port that is no number or out of range
    except ValueError as exc:
        # urlsplit's "Port out of range 0-65535" would contradict the range above.
        why = "" if masked or "out of range" in str(exc) else f": {exc}"
        raise argparse.ArgumentTypeError(f"{shown!r} has no valid port ({valid}){why}") from None
    if port is None and parts.netloc.endswith(":"):
        # "http://h:" (a port left out, as from "http://$HOST:$PORT" with PORT unset) dialled port 80.
        raise argparse.ArgumentTypeError(f"{shown!r} has no valid port ({valid}): nothing follows the ':'")
    if port == 0:
        # urlsplit takes port 0, no server's port: the tool then reported "Connection refused",
        # which says the server is down, not that the URL is wrong.
        raise argparse.ArgumentTypeError(f"{shown!r} has no valid port ({valid}): port 0 is no port a server "
                                         "listens on")
    if not parts.hostname:
        raise argparse.ArgumentTypeError(f"must be {shape}, got {shown!r}")
    return text


# A scheme and the slashes after it ("http://", or the typo "http:/"); one slash at least, so
# that "user:pw@host" (no scheme) is not read as scheme "user".
_SCHEME_PREFIX = re.compile(r"[A-Za-z][A-Za-z0-9+.-]*:/+")


def _masked_password(text: str) -> str:
    """``text`` with the password of its userinfo replaced by ``***`` (``http://u:***@host``).

    The userinfo is read as everything before the last ``@``, not as ``urlsplit`` reads it (up to
    the last ``@`` before the first ``/``, ``?`` or ``#``): a password may hold those characters
    (``user:s3c/ret@host``) or an ``@`` (``user:p@ss@host``), and is then shown, whole or in part,
    in the very refusal that says the URL is wrong.  A server URL has no ``@`` in its path, so
    masking too much where one does beats leaking a password into logs and terminals.
    """
    head, at, tail = text.rpartition("@")
    if not at:
        return text
    scheme = _SCHEME_PREFIX.match(head)
    start = scheme.end() if scheme else 0
    user, colon, _password = head[start:].partition(":")
    if not colon:
        return text  # a user name alone: no password to hide
    return f"{head[:start]}{user}:***@{tail}"


def _is_unbracketed_ipv6(host_port: str) -> bool:
    """Whether ``host_port`` (a URL's netloc less userinfo) is a bare IPv6 address, with or without
    a trailing ``:PORT`` (``::1:8000``, ``2001:db8::5``), rather than a name, IPv4 or bracketed."""
    if host_port.startswith("[") or host_port.count(":") < 2:
        return False
    for host in (host_port, host_port.rpartition(":")[0]):
        try:
            ipaddress.IPv6Address(host.partition("%")[0])
            return True
        except ValueError:
            continue
    return False


def http_url(text: str) -> str:
    """:func:`server_url` over HTTP or HTTPS."""
    return server_url(text)


def checkpoint_dir(text: str) -> str:
    """A local checkpoint directory: one with a ``config.json`` (checked before any server starts)."""
    if not Path(text, "config.json").is_file():
        raise argparse.ArgumentTypeError(f"{text!r} is not a local checkpoint directory (no config.json there)")
    return text


def listen_host(text: str) -> str:
    """A host the tool's servers can listen on: an IPv4 address or host name that resolves to an
    address of this machine.

    Checked the way the launch uses it (:func:`~lightllm.utils.free_ports.free_port` binds a
    port there), before anything starts: otherwise the first launch fails with a socket error's
    traceback after the prompts were built.
    """
    # Imported here: the other flags parse without zmq.
    from lightllm.utils.free_ports import free_port

    if not text:
        raise argparse.ArgumentTypeError("must name a host, got ''")
    bare = text[1:-1] if text.startswith("[") and text.endswith("]") else text
    try:
        ipv6 = ipaddress.ip_address(bare).version == 6
    except ValueError:
        ipv6 = False  # a host name: resolved below
    if ipv6:
        raise argparse.ArgumentTypeError(f"{text!r} is an IPv6 address; the servers are started on IPv4 "
                                         "(give an IPv4 address or a host name, e.g. 127.0.0.1)")
    try:
        free_port(text)
    except (OSError, UnicodeError, ValueError, TypeError) as exc:
        # gaierror (no such name), errno 99 (not an address of this machine), UnicodeError (a
        # label the IDNA codec refuses), TypeError (a NUL character).
        why = getattr(exc, "strerror", None) or str(exc)
        raise argparse.ArgumentTypeError(f"no server can listen on {text!r} here: {why}") from None
    return text


def missing_module(name: str) -> Optional[str]:
    """Why module ``name`` cannot be found (None when it can), found the way ``import`` would.

    Nothing is imported, not even its parent packages (whose ``__init__`` may load torch or
    start threads): each package's directories are searched for the next part of the name.
    """
    parts = name.split(".")
    if not all(part.isidentifier() for part in parts):
        return f"{name!r} is not a module name"
    if name in sys.modules:  # also what no finder finds, such as os.path
        return None
    try:
        spec = importlib.util.find_spec(parts[0])
    except ValueError:  # a top-level module already loaded without a spec
        spec = None
    for depth in range(2, len(parts) + 1):
        if spec is None or spec.submodule_search_locations is None:
            spec = None
            break
        spec = importlib.machinery.PathFinder.find_spec(".".join(parts[:depth]), list(spec.submodule_search_locations))
    return None if spec is not None else f"no module named {name!r} can be found"


def sequence_too_long(model_dir: str, lengths: Mapping[str, int], *, exact_attention: bool = True) -> Optional[str]:
    """Why a sequence of ``sum(lengths)`` tokens does not fit the model in ``model_dir`` (None when it does).

    ``lengths`` maps each flag to its tokens (``{"--prompt-len": 128, "--new-tokens": 64}``), so
    the refusal names what the user typed.  Checked before the model loads: the runtime refused
    an overlong sequence only in its first forward, and transformers computed past the
    positions the model was trained on.  ``exact_attention``: the limit is the window of a
    sliding-window model when shorter (our runtime attends to the whole sequence), not only the
    context the checkpoint declares (``max_position_embeddings``, times the factor of ``linear``
    and ``dynamic`` RoPE scaling).
    """
    from lightllm.benchmark.context_limit import ContextLimit
    from lightllm.common.basemodel.model_config import ModelConfig, ModelConfigError

    try:
        config = ModelConfig.from_dir(model_dir)
    except ModelConfigError as exc:
        return f"--model_dir {model_dir!r} holds no usable config.json: {exc}"
    return ContextLimit.of_checkpoint(config, model_dir, exact_attention=exact_attention).refusal(lengths)
