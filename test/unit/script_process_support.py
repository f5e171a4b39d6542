"""Stopping a launcher script (scripts/start_1p1d.sh) that a test left running."""

from __future__ import annotations

import os
import signal
import subprocess


def stop_script(proc: subprocess.Popen, wait_s: float) -> None:
    """Stop ``proc`` (started with ``start_new_session=True``) if it still runs.

    The servers it starts run in sessions of their own, so only the script's own stop (its
    SIGTERM trap) reaches them; its process group is killed only when that stop takes longer than
    ``wait_s`` (a SIGKILL of the group alone left all three servers running).
    """
    if proc.poll() is not None:
        return
    proc.send_signal(signal.SIGTERM)
    try:
        proc.wait(wait_s)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait(10)
