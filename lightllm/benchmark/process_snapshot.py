"""One moment of a server's process tree as /proc shows it: memory, libtorch mappings, age, CPU.

Read-only and Linux-only, kept apart from the launcher that starts the server and times it
(:mod:`.process_footprint`) so the parsing is unit-testable on its own.
"""

from __future__ import annotations

import os
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Dict, List, Optional, Tuple

from lightllm.benchmark.process_memory import child_pids, read_memory, server_processes

_PROC = Path("/proc")
# libtorch.so, libtorch_cpu.so, libtorch_python.so, libtorch_cuda.so, versioned suffixes too.
_LIBTORCH_RE = re.compile(r"^libtorch[A-Za-z0-9_]*\.so(\.[0-9]+)*$")


def torch_libraries(maps_text: str) -> List[str]:
    """Sorted distinct ``libtorch*.so`` file names mapped in a ``/proc/<pid>/maps`` text."""
    found = set()
    for line in maps_text.splitlines():
        parts = line.split(maxsplit=5)
        if len(parts) < 6:
            continue  # anonymous mapping
        path = parts[5].strip()
        # A library replaced on disk while mapped still counts: the process holds the old copy.
        if path.endswith(" (deleted)"):
            path = path[: -len(" (deleted)")]
        name = path.rsplit("/", 1)[-1]
        if _LIBTORCH_RE.match(name):
            found.add(name)
    return sorted(found)


@dataclass(frozen=True)
class StatTimes:
    """What ``/proc/<pid>/stat`` says about a process's age and CPU use, in clock ticks."""

    ppid: int
    utime: int
    stime: int
    starttime: int


def parse_stat(text: str) -> StatTimes:
    """Parse ``/proc/<pid>/stat``; raises ValueError when the text is too short."""
    # The command name may hold spaces and parentheses; the fields after the last ')' are fixed.
    rest = text[text.rfind(")") + 2 :].split()
    if len(rest) < 20:
        raise ValueError(f"not a /proc/<pid>/stat line: {text[:80]!r}")
    return StatTimes(ppid=int(rest[1]), utime=int(rest[11]), stime=int(rest[12]), starttime=int(rest[19]))


def entry_module_for(label: str, table: Dict[str, str]) -> Optional[str]:
    """The entry module of a process label; ``model_rank3`` uses the ``model_rank`` entry."""
    if label in table:
        return table[label]
    return table.get(label.rstrip("0123456789"))


@dataclass
class ProcessFootprint:
    """One process of the server tree at the moment it became ready."""

    label: str
    pid: int
    entry_module: Optional[str]
    rss_kib: int
    anon_kib: int
    file_kib: int
    shmem_kib: int
    maps_libtorch: bool
    torch_libraries: List[str] = field(default_factory=list)
    started_after_launch_s: Optional[float] = None  # relative to the launcher process's start
    cpu_s: Optional[float] = None  # user + system CPU spent up to the snapshot


def read_text_quietly(path: Path) -> str:
    """The file's text, or "" when it cannot be read (a process that exited meanwhile)."""
    try:
        return path.read_text(errors="replace")
    except OSError:
        return ""


def _tree(root_pid: int) -> List[Tuple[str, int]]:
    """``(label, pid)`` of the launcher, its children and (labelled under the parent) deeper ones."""
    result = list(server_processes(root_pid))
    queue = [(label, pid) for label, pid in result if pid != root_pid]
    while queue:
        parent_label, parent = queue.pop(0)
        for pid in child_pids(parent):
            comm = read_text_quietly(_PROC / str(pid) / "comm").strip() or "child"
            item = (f"{parent_label}/{comm}", pid)
            result.append(item)
            queue.append(item)
    return result


def snapshot(root_pid: int, entry_modules: Dict[str, str]) -> List[ProcessFootprint]:
    """Footprint of every live process under ``root_pid`` (the launcher itself included); each
    process's entry module looked up in ``entry_modules`` (:func:`entry_module_for`)."""
    ticks = os.sysconf("SC_CLK_TCK")
    root_stat = parse_stat(read_text_quietly(_PROC / str(root_pid) / "stat"))
    rows = []
    for label, pid in _tree(root_pid):
        try:
            memory = read_memory(pid)
            stat = parse_stat(read_text_quietly(_PROC / str(pid) / "stat"))
        except (ProcessLookupError, ValueError):
            continue  # exited between listing and reading
        libs = torch_libraries(read_text_quietly(_PROC / str(pid) / "maps"))
        rows.append(
            ProcessFootprint(
                label=label,
                pid=pid,
                entry_module=entry_module_for(label, entry_modules),
                rss_kib=memory.rss_kib,
                anon_kib=memory.anon_kib,
                file_kib=memory.file_kib,
                shmem_kib=memory.shmem_kib,
                maps_libtorch=bool(libs),
                torch_libraries=libs,
                started_after_launch_s=(stat.starttime - root_stat.starttime) / ticks,
                cpu_s=(stat.utime + stat.stime) / ticks,
            )
        )
    return rows
