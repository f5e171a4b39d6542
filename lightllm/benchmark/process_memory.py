"""Memory of a running server as the kernel sees it: RSS per process, /dev/shm use, leak verdict.

Everything here reads ``/proc`` and ``/dev/shm`` only (Linux), so the soak script can watch a
server it did not start, and the pure parts (parsing, the verdict) are unit-testable.
"""

from __future__ import annotations

import os
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Dict, List, Optional, Sequence, Tuple

_PROC = Path("/proc")
# Interpreter names mean "this child did not name itself", so it is labelled by spawn order.
_UNNAMED_COMMS = {"python", "python3", "pt_main_thread"}
_SPAWN_ORDER_LABELS = ("detokenization", "router")


@dataclass(frozen=True)
class MemorySample:
    """Resident memory of one process in KiB (``/proc/<pid>/status``).

    ``rss_kib`` is VmRSS; ``anon_kib`` the private heap/stack part, which is where a leak or a
    glibc heap that is never trimmed shows; ``shmem_kib`` counts mapped shared memory (the
    request buffer), which every process that maps it reports again.
    """

    rss_kib: int
    anon_kib: int
    file_kib: int
    shmem_kib: int

    def to_dict(self) -> Dict[str, int]:
        """JSON-friendly form."""
        return asdict(self)


def parse_status(text: str) -> MemorySample:
    """Parse the text of ``/proc/<pid>/status``; raises ValueError when VmRSS is missing."""
    fields: Dict[str, int] = {}
    for line in text.splitlines():
        name, _, rest = line.partition(":")
        if name in ("VmRSS", "RssAnon", "RssFile", "RssShmem"):
            parts = rest.split()
            if parts:
                fields[name] = int(parts[0])
    if "VmRSS" not in fields:
        raise ValueError("no VmRSS line in the status text (kernel thread or not a Linux /proc?)")
    return MemorySample(fields["VmRSS"], fields.get("RssAnon", 0), fields.get("RssFile", 0), fields.get("RssShmem", 0))


def read_memory(pid: int) -> MemorySample:
    """Current memory of ``pid``; raises ProcessLookupError when it is gone."""
    try:
        return parse_status((_PROC / str(pid) / "status").read_text())
    except FileNotFoundError:
        raise ProcessLookupError(f"process {pid} does not exist") from None


def _read(path: Path) -> str:
    try:
        return path.read_text(errors="replace")
    except OSError:
        return ""


def _stat_fields(pid: int) -> Tuple[int, int]:
    """(parent pid, start time in clock ticks) from ``/proc/<pid>/stat``."""
    text = _read(_PROC / str(pid) / "stat")
    # The command name may hold spaces and parentheses; the fields after the last ')' are fixed.
    rest = text[text.rfind(")") + 2 :].split()
    if len(rest) < 20:
        return -1, 0
    return int(rest[1]), int(rest[19])


def child_pids(pid: int) -> List[int]:
    """Direct children of ``pid``, oldest first."""
    found = []
    for entry in _PROC.iterdir():
        if entry.name.isdigit():
            parent, started = _stat_fields(int(entry.name))
            if parent == pid:
                found.append((started, int(entry.name)))
    return [child for _, child in sorted(found)]


def server_processes(root_pid: int) -> List[Tuple[str, int]]:
    """``(label, pid)`` of a server's main process and its children.

    Children label themselves through ``/proc/<pid>/comm`` (``run_child`` sets it); an unnamed
    child is labelled by spawn order (detokenization, router, then the model ranks).
    """
    result = [("main", root_pid)]
    unnamed = 0
    for child in child_pids(root_pid):
        comm = _read(_PROC / str(child) / "comm").strip()
        cmdline = _read(_PROC / str(child) / "cmdline").replace("\0", " ")
        if "resource_tracker" in cmdline:
            label = "resource_tracker"
        elif comm and comm not in _UNNAMED_COMMS:
            label = comm
        else:
            label = _SPAWN_ORDER_LABELS[unnamed] if unnamed < len(_SPAWN_ORDER_LABELS) else f"model_rank{unnamed - 2}"
            unnamed += 1
        result.append((label, child))
    return result


def shm_usage(root: str = "/dev/shm", prefix: str = "", skip_suffix: str = "") -> Dict[str, int]:
    """Bytes and files under ``root`` (only names starting with ``prefix`` when given, none ending
    with ``skip_suffix`` when given)."""
    total = files = 0
    try:
        entries = list(os.scandir(root))
    except OSError:
        return {"bytes": 0, "files": 0}
    for entry in entries:
        if prefix and not entry.name.startswith(prefix):
            continue
        if skip_suffix and entry.name.endswith(skip_suffix):
            continue
        try:
            stat = entry.stat(follow_symlinks=False)
        except OSError:
            continue
        # st_blocks counts what tmpfs really holds; a sparse segment is not charged its size.
        total += stat.st_blocks * 512
        files += 1
    return {"bytes": total, "files": files}


@dataclass(frozen=True)
class LeakVerdict:
    """Whether one process's RSS stayed flat between the first and the last round."""

    label: str
    first_kib: int
    last_kib: int
    growth: float  # (last - first) / first
    holds: bool


def leak_verdicts(per_round: Sequence[Dict[str, int]], tolerance: float = 0.05) -> List[LeakVerdict]:
    """Compare each process's RSS after the last round with after the first one.

    ``per_round[i]`` maps a process label to its RSS (KiB) after round ``i + 1``.  A process
    holds when its last RSS is at most ``(1 + tolerance)`` times its first; a process missing
    from the last round (it died) never holds.  Needs at least two rounds.
    """
    if tolerance < 0:
        raise ValueError(f"tolerance must be >= 0, got {tolerance}")
    if len(per_round) < 2:
        raise ValueError(f"the leak criterion needs at least two rounds, got {len(per_round)}")
    first, last = per_round[0], per_round[-1]
    verdicts = []
    for label, first_kib in first.items():
        last_kib: Optional[int] = last.get(label)
        if last_kib is None or first_kib <= 0:
            verdicts.append(LeakVerdict(label, first_kib, last_kib or 0, float("inf"), False))
            continue
        growth = (last_kib - first_kib) / first_kib
        verdicts.append(LeakVerdict(label, first_kib, last_kib, growth, growth <= tolerance))
    return verdicts
