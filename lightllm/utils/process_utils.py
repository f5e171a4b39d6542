"""Helpers shared by the server's child processes: signals, readiness reports and zmq sockets."""

from __future__ import annotations

import logging
import multiprocessing
import os
import signal
import threading
import time
import traceback
from typing import Any, Callable, Optional, Tuple, Type

import zmq


# A signal to the whole process group (Ctrl-C in a terminal, systemd's default control-group
# stop, ``kill -- -PGID``) reaches the children as well as the main process.  The main process
# drains (``--graceful_shutdown_seconds``) and then stops its children itself, so children ignore
# SIGINT and SIGTERM, and the main process stops one with this signal, whose default action ends
# the process as SIGTERM's did.
CHILD_STOP_SIGNAL = signal.SIGUSR1


def describe_exit_code(exitcode: Optional[int]) -> str:
    """``exit code N``, or for a child killed by a signal its name (``killed by SIGBUS, exit code -7``).

    multiprocessing reports a signal death as a negative exit code, which few readers decode; a
    SIGBUS of a server child is almost always a shared-memory page that could not be backed.
    """
    if exitcode is None or exitcode >= 0:
        return f"exit code {exitcode}"
    try:
        name = signal.Signals(-exitcode).name
    except ValueError:
        return f"killed by signal {-exitcode}, exit code {exitcode}"
    if -exitcode == signal.SIGBUS:
        return (f"killed by {name}, exit code {exitcode}: a shared-memory page could not be backed, usually because "
                "/dev/shm ran out of space (docs/EN/memory.md, Shared memory)")
    return f"killed by {name}, exit code {exitcode}"


def ignore_group_stop_signals() -> None:
    """Let SIGINT, SIGTERM and SIGHUP pass this process by: its parent decides when it stops."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    signal.signal(signal.SIGHUP, signal.SIG_IGN)


def start_resource_tracker_deaf_to_hangup() -> None:
    """Start multiprocessing's resource tracker now (or again, if it died), deaf to SIGHUP.

    The tracker (it unlinks the server's shared memory if the server is killed) ignores SIGINT
    and SIGTERM itself, not SIGHUP: a hang-up of the server's process group (a closed terminal)
    killed it, and the replacement started for the next release printed a traceback for every
    segment it had never seen.  SIGHUP is blocked in the calling thread while the tracker starts:
    a blocked signal stays blocked across the exec, and the tracker unblocks only SIGINT and
    SIGTERM, so a hang-up stays pending there for good.  A signal mask, unlike a disposition, can
    be set from any thread (the launcher's child watcher restarts a dead tracker).  Call it before
    the first shared memory segment exists (that starts the tracker otherwise).
    """
    from multiprocessing import resource_tracker

    previous = signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGHUP})
    try:
        resource_tracker.ensure_running()
    finally:
        signal.pthread_sigmask(signal.SIG_SETMASK, previous)


def zmq_socket(ctx: zmq.Context, kind: int, address: str, bind: bool) -> zmq.Socket:
    """A zmq socket bound or connected to ``address`` that never blocks on close."""
    sock = ctx.socket(kind)
    sock.setsockopt(zmq.LINGER, 0)
    if bind:
        sock.bind(address)
    else:
        sock.connect(address)
    return sock


# prctl(2) option: the signal this process gets when the thread that started it exits.
PR_SET_PDEATHSIG = 1


def arm_parent_death_signal() -> bool:
    """Have the kernel SIGKILL this process the moment its parent dies (Linux); False where it cannot.

    The kernel ties the signal to the *thread* that started this process, not to its parent process:
    start such a child only from a thread that lives as long as its process (the launcher spawns its
    children from its main thread; a model rank its KV transfer processes from its step loop).
    """
    try:
        import ctypes

        libc = ctypes.CDLL(None, use_errno=True)
        return libc.prctl(PR_SET_PDEATHSIG, int(signal.SIGKILL), 0, 0, 0) == 0
    except (OSError, AttributeError):
        return False


def _exit_with_parent() -> None:
    """A child must not outlive a parent that was killed without cleaning up.

    The parent-death signal ends it at once, even while it is stopped (SIGSTOP) or holds the GIL in
    C code: such a child kept multiprocessing's resource tracker's pipe open, so a SIGKILLed
    launcher's shared memory stayed in /dev/shm until the child was killed too.  The thread that
    checks the parent every second stays for systems without ``prctl``.
    """
    # The launcher's pid, as its spawn (a direct fork and exec) passed it: None when not started by
    # multiprocessing, and then nothing is tied to a parent but the watch below.
    spawner = multiprocessing.parent_process()
    parent = spawner.pid if spawner is not None else os.getppid()
    if spawner is not None and arm_parent_death_signal() and os.getppid() != parent:
        os._exit(1)  # the parent died before the signal was armed: nothing would ever deliver it

    def watch() -> None:
        while True:
            time.sleep(1.0)
            if os.getppid() != parent:
                os._exit(1)

    threading.Thread(target=watch, name="parent-watch", daemon=True).start()


def set_process_name(name: str) -> None:
    """Name this process in ``/proc/<pid>/comm`` (what ``top`` and the soak script show).

    Spawned children all run as ``python``; naming them lets an operator see which one holds
    the memory.  Linux keeps the first 15 bytes; elsewhere this does nothing.
    """
    try:
        import ctypes

        libc = ctypes.CDLL(None, use_errno=True)
        libc.prctl(15, ctypes.c_char_p(name.encode()[:15]), 0, 0, 0)  # 15 = PR_SET_NAME
    except (OSError, AttributeError):
        pass


def run_child(
    name: str,
    ready_conn: Any,
    body: Callable[[Callable[[], None]], None],
    refused: Tuple[Type[BaseException], ...] = (),
    consequential: Callable[[BaseException], bool] = lambda exc: False,
) -> None:
    """Run a child process body; report readiness or the start-up error to the parent.

    ``body`` receives a ``mark_ready`` callable to invoke once it can serve.  Exceptions before
    readiness travel to the parent as text: ``("error", "<name>: <type>: <message>")``, or, for
    the types in ``refused`` (a setting the child found it cannot honour, such as a model rank's
    explicit kernel backend), ``("refused", "<message>")``, which the launcher prints as is and
    exits 2 on, as if it had checked the flag itself.  After readiness exceptions are logged and
    the process exits non-zero so the parent's supervisor notices; one that ``consequential``
    says follows another process's death (a TP rank's collective whose peer rank died) is logged
    as one warning line, its traceback at debug level: the supervisor's line names the cause.
    """
    ignore_group_stop_signals()
    _exit_with_parent()
    set_process_name(name)
    log = logging.getLogger(f"lightllm.{name}")
    state = {"ready": False}

    def mark_ready() -> None:
        state["ready"] = True
        ready_conn.send(("ready", name))

    try:
        body(mark_ready)
    except Exception as exc:  # report any failure, the parent prints one line
        if not state["ready"] and refused and isinstance(exc, refused):
            ready_conn.send(("refused", str(exc)))
        elif not state["ready"]:
            ready_conn.send(("error", f"{name}: {type(exc).__name__}: {exc}"))
            log.debug("start-up failure\n%s", traceback.format_exc())
        elif consequential(exc):
            log.warning("%s stopped: %s (another process it works with exited; the supervisor's line names it)",
                        name, str(exc).splitlines()[0][:300] if str(exc) else type(exc).__name__)
            log.debug("%s", traceback.format_exc())
        else:
            log.error("%s crashed: %s\n%s", name, exc, traceback.format_exc())
        os._exit(1)
