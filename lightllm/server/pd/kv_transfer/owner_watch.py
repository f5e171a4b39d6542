"""A transfer process ends as soon as the rank process that started it is gone.

A rank process exits within about a second of its node's main process being killed (its own
parent watch), but a transfer process is the rank's child: without a watch of its own it would
live on as an orphan, for as long as its current wait on the peer or the store lasts (a store
connect retries for the whole connect timeout, 60 s), and keep a dead node's pair looking alive
to its peer.  Two mechanisms, because either alone has a gap:

* ``PR_SET_PDEATHSIG`` (Linux): the kernel sends SIGKILL the moment the owner dies, even while
  this process sits in C++ holding the GIL or is stopped.  The kernel ties it to the thread that
  started the process, so an owner must start its transfer processes from a thread that lives
  as long as it does (a rank starts them from its step loop, on its main thread).
* a thread that checks every :data:`OWNER_CHECK_S` whether this process was re-parented (the
  owner is gone), for systems without ``prctl``.
"""

from __future__ import annotations

import os
import threading
import time

from lightllm.utils.process_utils import arm_parent_death_signal

# How often the fallback thread checks for its owner.
OWNER_CHECK_S = 0.2


def exit_with_owner(owner_pid: int) -> None:
    """End this process (exit code 0) once process ``owner_pid``, its parent, is gone; 0: no watch."""
    if owner_pid <= 0:
        return
    arm_parent_death_signal()  # False where prctl is missing (not Linux): the watch thread alone
    if os.getppid() != owner_pid:
        # The owner died before the signal was armed: nothing would ever deliver it.
        os._exit(0)

    def watch() -> None:
        while True:
            time.sleep(OWNER_CHECK_S)
            if os.getppid() != owner_pid:
                os._exit(0)

    threading.Thread(target=watch, name="kv-transfer-owner-watch", daemon=True).start()
