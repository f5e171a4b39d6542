"""Does ``/dev/shm`` hold the segments a server is about to create?

The segments are sparse: pages are backed only as requests touch them, so the server starts
whatever their size.  But once traffic touches more than ``/dev/shm`` holds (a container's
64 MiB default is the usual limit), the process that touches the next page dies of SIGBUS in
the middle of a request.  The launcher therefore compares the segments' full size with the
free space before it creates them and refuses to start, in one line naming the flags that size
them, when they would not fit.  A machine without ``/dev/shm`` (not Linux) is not checked.

The free space counts only pages already touched, so a second server on the same ``/dev/shm``
saw the first one's untouched pages as free, passed this check, and both died of SIGBUS under
load.  The untouched part of other running servers' segments (size minus allocated blocks) is
therefore taken off the free space first.
"""

from __future__ import annotations

import logging
import os
from pathlib import Path
from typing import List, Optional, Tuple

from lightllm.server.argument_error import ArgumentError
from lightllm.server.server_layout import ServerLayout
from lightllm.utils.owner_locks import SHM_DIR
from lightllm.utils.stale_resources import live_segments_of_others

log = logging.getLogger("lightllm.shm_capacity")


def shm_free_bytes(shm_dir: Path = SHM_DIR) -> Optional[int]:
    """Bytes an unprivileged process may still allocate in ``shm_dir``; None when it cannot be read."""
    try:
        stats = os.statvfs(shm_dir)
    except OSError:
        return None
    return stats.f_bavail * stats.f_frsize


def format_bytes(count: int) -> str:
    """``count`` in the largest binary unit that keeps it >= 1 (``1.5 GiB``)."""
    value = float(count)
    for unit in ("B", "KiB", "MiB", "GiB"):
        if value < 1024 or unit == "GiB":
            return f"{value:.0f} {unit}" if unit == "B" else f"{value:.1f} {unit}"
        value /= 1024
    raise AssertionError("unreachable")


def describe_shm_use(layout: ServerLayout) -> str:
    """One line with each segment's size and what sets it, for the start-up log."""
    sizes = layout.shm_segment_bytes()
    total = sum(sizes.values())
    line = (
        f"shared memory: {format_bytes(total)} in all: request records {format_bytes(sizes['request records'])} "
        f"({layout.slot_num} slots x {layout.max_req_total_len} tokens), top-logprob rows "
        f"{format_bytes(sizes['top-logprob rows'])} ({layout.top_slot_num} slots), counters "
        f"{format_bytes(sizes['counters'])}"
    )
    if "heartbeats" in sizes:  # --watchdog_timeout: one field per watched child
        line += f", heartbeats {format_bytes(sizes['heartbeats'])} ({', '.join(layout.heartbeat_processes)})"
    return line


def untouched_bytes_of_others(shm_dir: Path = SHM_DIR) -> Tuple[int, List[Path]]:
    """Bytes other running servers' segments in ``shm_dir`` may still take as they are touched, and those segments."""
    pending, segments = 0, []
    for path in live_segments_of_others(shm_dir):
        try:
            stats = path.stat()
        except OSError:
            continue  # its server stopped since the listing
        untouched = max(0, stats.st_size - stats.st_blocks * 512)  # st_blocks counts 512-byte units
        if untouched:
            pending += untouched
            segments.append(path)
    return pending, segments


def check_shm_capacity(layout: ServerLayout, free_bytes: Optional[int], shm_dir: Path = SHM_DIR) -> None:
    """Raise :class:`ArgumentError` (one line) when ``layout``'s segments need more than ``shm_dir`` can give.

    ``free_bytes``: the free space of ``shm_dir`` (:func:`shm_free_bytes`); None skips the check.
    Other running servers' untouched pages (:func:`untouched_bytes_of_others`) are not free.
    """
    if free_bytes is None:
        return
    sizes = layout.shm_segment_bytes()
    total = sum(sizes.values())
    pending, others = untouched_bytes_of_others(shm_dir)
    if total <= free_bytes - pending:
        return
    promised = ""
    if pending:
        share = "of it" if pending <= free_bytes else "(more than is free)"
        promised = (f", and other running servers there may still take {format_bytes(pending)} {share} (the "
                    f"untouched part of their {len(others)} segment(s), written as their requests arrive)")
    raise ArgumentError(
        f"the server's shared memory needs {format_bytes(total)} (request records "
        f"{format_bytes(sizes['request records'])}, top-logprob rows {format_bytes(sizes['top-logprob rows'])}) "
        f"but {shm_dir} has {format_bytes(free_bytes)} free{promised}; lower --max_req_total_len "
        f"({layout.max_req_total_len}), --running_max_req_size (sets the {layout.slot_num} request slots) or "
        f"--top_logprobs_slots ({layout.top_slot_num}), or give {shm_dir} more space (docker: --shm-size)"
    )
